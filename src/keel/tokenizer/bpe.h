// The BPE model of a tokenizer.json: vocabulary, ranked merges, and the merge loop
// (lowest rank first, leftmost first among equals, as tokenizers' Word::merge_all), with
// a bounded, thread-safe cache of pieces already seen.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace keel::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // byte_level: pieces are raw bytes and each byte is one initial symbol (its GPT-2
  // character's token); otherwise each UTF-8 character is one.
  BpeModel(const nlohmann::json& model, bool byte_level, const std::string& file);
  ~BpeModel();

  // Appends the ids of one pre-tokenized piece.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

  // Vocabulary in tokenizer.json's spelling (byte-level characters for byte-level BPE).
  std::optional<int32_t> id(std::string_view token) const;
  const std::vector<std::string>& tokens() const { return tokens_; }  // by id; "" = none
  const TokenMap& vocab() const { return vocab_; }

  // Exposed for tests: the merge loop with the heap (used for long pieces) or the
  // linear scan (short pieces) over the same initial symbols.
  std::vector<int32_t> merge_for_test(std::string_view piece, bool heap) const;

 private:
  struct MergeTable;
  void initial_symbols(std::string_view piece, std::vector<int32_t>& syms) const;
  void merge_linear(std::vector<int32_t>& syms) const;
  void merge_heap(std::vector<int32_t>& syms) const;

  TokenMap vocab_;
  std::vector<std::string> tokens_;
  std::unique_ptr<MergeTable> merges_;
  bool byte_level_;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  int32_t byte_ids_[256];           // byte-level: each byte's symbol, -1 if absent
  int32_t fallback_ids_[256];       // byte_fallback: <0xXX> tokens, -1 if absent
  TokenMap byte_vocab_;             // byte-level + ignore_merges: tokens as raw bytes

  // Cache: piece -> ids, sharded so concurrent encodes rarely contend.
  static constexpr size_t kShards = 64;
  static constexpr size_t kShardCapacity = 4096;
  static constexpr size_t kMaxCachedPiece = 256;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  std::unique_ptr<Shard[]> cache_;
};

}  // namespace keel::tok
