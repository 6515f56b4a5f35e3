#include "tokenizer/bpe.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <queue>

#include "base/error.h"
#include "tokenizer/utf8.h"

namespace keel::tok {
namespace {

using nlohmann::json;

constexpr size_t kLinearMergeLimit = 48;  // longer pieces use the heap

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

// Open addressing on (left id, right id) -> (rank, merged id).
struct BpeModel::MergeTable {
  struct Entry {
    uint64_t key;
    int32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  std::vector<Entry> slots;
  uint64_t mask = 0;

  explicit MergeTable(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots.assign(cap, Entry{kEmpty, 0, 0});
    mask = cap - 1;
  }
  static uint64_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return k;
  }
  void put(uint64_t key, int32_t rank, int32_t merged) {
    for (uint64_t i = hash(key) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == kEmpty || slots[i].key == key) {
        slots[i] = {key, rank, merged};  // a repeated merge keeps the later rank
        return;
      }
    }
  }
  const Entry* get(int32_t a, int32_t b) const {
    const uint64_t key = pair_key(a, b);
    for (uint64_t i = hash(key) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == key) return &slots[i];
      if (slots[i].key == kEmpty) return nullptr;
    }
  }
};

BpeModel::~BpeModel() = default;

BpeModel::BpeModel(const json& model, bool byte_level, const std::string& file)
    : byte_level_(byte_level), cache_(new Shard[kShards]) {
  const auto bad = [&](const std::string& field, const std::string& msg) {
    fail(ErrorCode::tokenizer_json, {.file = file, .field = "model." + field}, msg);
  };
  const auto unsupported = [&](const std::string& field, const std::string& msg) {
    fail(ErrorCode::tokenizer_unsupported, {.file = file, .field = "model." + field}, msg);
  };
  if (!model.is_object()) bad("", "expected an object");
  if (model.contains("type") && model["type"] != "BPE")
    unsupported("type", "model '" + model["type"].dump() + "' is not supported (only BPE)");
  const auto str_opt = [&](const char* key) -> std::string {
    if (!model.contains(key) || model[key].is_null()) return {};
    if (!model[key].is_string()) bad(key, "expected a string or null");
    return model[key].get<std::string>();
  };
  const auto bool_opt = [&](const char* key) {
    if (!model.contains(key) || model[key].is_null()) return false;
    if (!model[key].is_boolean()) bad(key, "expected a boolean");
    return model[key].get<bool>();
  };
  if (!str_opt("continuing_subword_prefix").empty())
    unsupported("continuing_subword_prefix", "BPE continuing_subword_prefix is not supported");
  if (!str_opt("end_of_word_suffix").empty())
    unsupported("end_of_word_suffix", "BPE end_of_word_suffix is not supported");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    unsupported("dropout", "BPE dropout is not supported (encoding would not be deterministic)");
  ignore_merges_ = bool_opt("ignore_merges");
  byte_fallback_ = bool_opt("byte_fallback");
  fuse_unk_ = bool_opt("fuse_unk");

  if (!model.contains("vocab") || !model["vocab"].is_object()) bad("vocab", "expected an object");
  const json& vocab = model["vocab"];
  vocab_.reserve(vocab.size());
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) bad("vocab", "id of '" + it.key() + "' is not an integer");
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= (int64_t{1} << 30)) bad("vocab", "id of '" + it.key() + "' out of range");
    vocab_.emplace(it.key(), static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : vocab_) tokens_[id] = tok;

  const std::string unk = str_opt("unk_token");
  if (!unk.empty()) {
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) bad("unk_token", "unk_token '" + unk + "' is not in the vocabulary");
    unk_id_ = it->second;
  }

  if (!model.contains("merges") || !model["merges"].is_array()) bad("merges", "expected an array");
  const json& merges = model["merges"];
  merges_ = std::make_unique<MergeTable>(merges.size());
  std::string merged;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string_view a, b;
    std::string joined;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        bad("merges[" + std::to_string(rank) + "]", "merge '" + s + "' is not two tokens");
      a = std::string_view(s).substr(0, sp);
      b = std::string_view(s).substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get_ref<const std::string&>();
      b = m[1].get_ref<const std::string&>();
    } else {
      bad("merges[" + std::to_string(rank) + "]", "expected \"a b\" or [\"a\", \"b\"]");
    }
    merged.assign(a);
    merged.append(b);
    const auto ia = vocab_.find(a), ib = vocab_.find(b), im = vocab_.find(merged);
    if (ia == vocab_.end() || ib == vocab_.end() || im == vocab_.end())
      bad("merges[" + std::to_string(rank) + "]",
          "merge '" + std::string(a) + " " + std::string(b) + "' uses a token not in the vocabulary");
    merges_->put(pair_key(ia->second, ib->second), static_cast<int32_t>(rank), im->second);
  }

  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  std::fill(std::begin(fallback_ids_), std::end(fallback_ids_), -1);
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(ch, byte_to_char()[b]);
    if (auto it = vocab_.find(ch); it != vocab_.end()) byte_ids_[b] = it->second;
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    if (auto it = vocab_.find(std::string_view(hex)); it != vocab_.end()) fallback_ids_[b] = it->second;
  }
  if (byte_level_ && ignore_merges_) {
    // Whole-piece lookups need the vocabulary spelled as raw bytes.
    for (const auto& [tok, id] : vocab_) {
      std::string raw;
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        const Utf8Step st = utf8_step(tok, i);
        const int byte = st.valid ? byte_of_char(st.cp) : -1;
        ok = byte >= 0;
        raw += static_cast<char>(byte);
        i += st.length;
      }
      if (ok) byte_vocab_.emplace(std::move(raw), id);
    }
  }
}

std::optional<int32_t> BpeModel::id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::initial_symbols(std::string_view piece, std::vector<int32_t>& syms) const {
  syms.clear();
  // A pending unknown run: tokenizers emits one unk per unknown character, or one per
  // run of them with fuse_unk; without an unk token, unknown characters are dropped.
  bool unk_pending = false;
  const auto flush_unk = [&] {
    if (unk_pending) syms.push_back(unk_id_);
    unk_pending = false;
  };
  const auto unknown = [&] {
    if (unk_id_ < 0) return;
    if (unk_pending && !fuse_unk_) syms.push_back(unk_id_);
    unk_pending = true;
  };
  if (byte_level_) {
    for (const char c : piece) {
      const int32_t id = byte_ids_[static_cast<unsigned char>(c)];
      if (id >= 0) {
        flush_unk();
        syms.push_back(id);
      } else {
        unknown();
      }
    }
    flush_unk();
    return;
  }
  for (size_t i = 0; i < piece.size();) {
    const size_t len = utf8_lead_length(static_cast<unsigned char>(piece[i]));
    const std::string_view ch = piece.substr(i, len);
    i += len;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      flush_unk();
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char c : ch) all = all && fallback_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        flush_unk();
        for (const char c : ch) syms.push_back(fallback_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    unknown();
  }
  flush_unk();
}

void BpeModel::merge_linear(std::vector<int32_t>& syms) const {
  // Repeatedly merge the lowest-ranked adjacent pair, leftmost first: the order in which
  // the heap of tokenizers' merge_all applies its valid entries.
  while (syms.size() > 1) {
    int32_t best_rank = INT32_MAX, best_merged = -1;
    size_t best = 0;
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      const MergeTable::Entry* e = merges_->get(syms[i], syms[i + 1]);
      if (e && e->rank < best_rank) best_rank = e->rank, best_merged = e->merged, best = i;
    }
    if (best_merged < 0) break;
    syms[best] = best_merged;
    syms.erase(syms.begin() + static_cast<ptrdiff_t>(best) + 1);
  }
}

void BpeModel::merge_heap(std::vector<int32_t>& syms) const {
  const size_t n = syms.size();
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Cand {
    int32_t rank, pos, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue;
  for (size_t i = 0; i + 1 < n; ++i)
    if (const auto* e = merges_->get(syms[i], syms[i + 1]))
      queue.push({e->rank, static_cast<int32_t>(i), e->merged});
  while (!queue.empty()) {
    const Cand top = queue.top();
    queue.pop();
    const int32_t p = top.pos;
    if (!alive[p] || next[p] < 0) continue;
    const int32_t q = next[p];
    // Stale entry: the pair at p is no longer the one this merge was queued for.
    const auto* e = merges_->get(syms[p], syms[q]);
    if (!e || e->merged != top.merged) continue;
    syms[p] = top.merged;
    alive[q] = false;
    next[p] = next[q];
    if (next[q] >= 0) prev[next[q]] = p;
    if (prev[p] >= 0)
      if (const auto* l = merges_->get(syms[prev[p]], syms[p])) queue.push({l->rank, prev[p], l->merged});
    if (next[p] >= 0)
      if (const auto* r = merges_->get(syms[p], syms[next[p]])) queue.push({r->rank, p, r->merged});
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) syms[w++] = syms[i];
  syms.resize(w);
}

std::vector<int32_t> BpeModel::merge_for_test(std::string_view piece, bool heap) const {
  std::vector<int32_t> syms;
  initial_symbols(piece, syms);
  heap ? merge_heap(syms) : merge_linear(syms);
  return syms;
}

void BpeModel::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    const TokenMap& whole = byte_level_ ? byte_vocab_ : vocab_;
    if (auto it = whole.find(piece); it != whole.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = piece.size() <= kMaxCachedPiece;
  Shard* shard = nullptr;
  if (cacheable) {
    shard = &cache_[StringHash{}(piece) % kShards];
    std::lock_guard lock(shard->mu);
    if (auto it = shard->map.find(piece); it != shard->map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<int32_t> syms;
  initial_symbols(piece, syms);
  if (syms.size() <= kLinearMergeLimit)
    merge_linear(syms);
  else
    merge_heap(syms);
  out.insert(out.end(), syms.begin(), syms.end());
  if (cacheable) {
    std::lock_guard lock(shard->mu);
    if (shard->map.size() >= kShardCapacity) shard->map.clear();
    shard->map.emplace(std::string(piece), syms);
  }
}

}  // namespace keel::tok
