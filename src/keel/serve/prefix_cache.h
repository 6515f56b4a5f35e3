// Prefix caching across requests (docs/serve.md): snapshots of a sequence's whole state
// after the first k·block tokens of a prompt, keyed by those tokens. A DeepSeek-V4
// sequence's state is more than its compressed entries: the sliding-window ring, the
// open compressor windows, the CSA carry and the indexer keys all belong to the prefix,
// and a snapshot (Executor::clone) holds every one of them, so a request that restores
// it continues exactly as if it had run the prefix itself. On the CPU a snapshot shares
// the sequence's state blocks (model/block_pool.h) until either side writes, and the
// budget counts every block a snapshot refers to, shared or not.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "model/executor.h"

namespace keel::serve {

class PrefixCache {
 public:
  // budget_bytes 0: no caching. block: prefix lengths are multiples of it.
  PrefixCache(uint64_t budget_bytes, int block) : budget_(budget_bytes), block_(block) {}

  int block() const { return block_; }
  bool enabled() const { return budget_ > 0 && block_ > 0; }

  // The longest cached prefix of `tokens` of at most `limit` tokens; {0, nullptr} if none.
  // Counts a query, and a hit when found.
  std::pair<int64_t, const SequenceState*> longest(std::span<const int32_t> tokens, int64_t limit);
  // Whether `prefix` (a whole number of blocks) is worth a snapshot: not cached yet.
  bool wants(std::span<const int32_t> prefix) const;
  // Keeps `state` (the state after `prefix`), evicting the least recently used
  // snapshots until the budget holds; a snapshot larger than the budget is dropped.
  void insert(std::span<const int32_t> prefix, std::unique_ptr<SequenceState> state);
  // Drops the least recently used snapshot (its state's blocks go back to the pool unless
  // a running sequence shares them); false when there is none.
  bool evict_oldest();

  uint64_t queries() const { return queries_; }
  uint64_t hits() const { return hits_; }
  uint64_t hit_tokens() const { return hit_tokens_; }
  uint64_t bytes() const { return bytes_; }
  size_t entries() const { return entries_.size(); }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<SequenceState> state;
    uint64_t bytes = 0;
    mutable uint64_t last_used = 0;  // the LRU clock, bumped by lookups
  };
  static uint64_t extend(uint64_t hash, std::span<const int32_t> tokens);
  const Entry* find(uint64_t hash, std::span<const int32_t> prefix) const;

  uint64_t budget_;
  int block_;
  std::multimap<uint64_t, Entry> entries_;  // by the prefix's hash
  uint64_t bytes_ = 0, clock_ = 0, queries_ = 0, hits_ = 0, hit_tokens_ = 0;
};

}  // namespace keel::serve
