#include "serve/prefix_cache.h"

#include <algorithm>

namespace keel::serve {

// FNV-1a over the ids, extended block by block.
uint64_t PrefixCache::extend(uint64_t hash, std::span<const int32_t> tokens) {
  for (const int32_t id : tokens) {
    for (int b = 0; b < 4; ++b) {
      hash ^= (static_cast<uint32_t>(id) >> (8 * b)) & 0xffu;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull;

const PrefixCache::Entry* PrefixCache::find(uint64_t hash, std::span<const int32_t> prefix) const {
  auto [first, last] = entries_.equal_range(hash);
  for (auto it = first; it != last; ++it) {
    if (std::ranges::equal(it->second.tokens, prefix)) return &it->second;
  }
  return nullptr;
}

std::pair<int64_t, const SequenceState*> PrefixCache::longest(std::span<const int32_t> tokens, int64_t limit) {
  if (!enabled()) return {0, nullptr};
  ++queries_;
  std::pair<int64_t, const SequenceState*> best{0, nullptr};
  uint64_t hash = kOffsetBasis;
  const Entry* found = nullptr;
  for (int64_t end = block_; end <= std::min<int64_t>(limit, static_cast<int64_t>(tokens.size())); end += block_) {
    hash = extend(hash, tokens.subspan(end - block_, block_));
    if (const Entry* e = find(hash, tokens.first(end))) {
      found = e;
      best = {end, e->state.get()};
    }
  }
  if (found) {
    found->last_used = ++clock_;
    ++hits_;
    hit_tokens_ += static_cast<uint64_t>(best.first);
  }
  return best;
}

bool PrefixCache::wants(std::span<const int32_t> prefix) const {
  if (!enabled() || prefix.empty() || prefix.size() % static_cast<size_t>(block_) != 0) return false;
  return find(extend(kOffsetBasis, prefix), prefix) == nullptr;
}

void PrefixCache::insert(std::span<const int32_t> prefix, std::unique_ptr<SequenceState> state) {
  const uint64_t bytes = state->bytes() + prefix.size_bytes();
  if (!wants(prefix) || bytes > budget_) return;
  while (bytes_ + bytes > budget_) evict_oldest();
  Entry e{std::vector<int32_t>(prefix.begin(), prefix.end()), std::move(state), bytes, ++clock_};
  entries_.emplace(extend(kOffsetBasis, prefix), std::move(e));
  bytes_ += bytes;
}

bool PrefixCache::evict_oldest() {
  if (entries_.empty()) return false;
  auto oldest = std::min_element(entries_.begin(), entries_.end(),
                                 [](const auto& a, const auto& b) { return a.second.last_used < b.second.last_used; });
  bytes_ -= oldest->second.bytes;
  entries_.erase(oldest);
  return true;
}

}  // namespace keel::serve
