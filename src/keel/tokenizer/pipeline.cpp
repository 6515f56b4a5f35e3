#include "tokenizer/pipeline.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "tokenizer/utf8.h"

namespace keel::tok {
namespace {

using nlohmann::json;

[[noreturn]] void bad_json(const std::string& file, const std::string& field, const std::string& msg) {
  fail(ErrorCode::tokenizer_json, {.file = file, .field = field}, msg);
}

[[noreturn]] void unsupported(const std::string& file, const std::string& field,
                              const std::string& msg) {
  fail(ErrorCode::tokenizer_unsupported, {.file = file, .field = field}, msg);
}

std::string type_of(const json& j, const std::string& file, const std::string& field) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    bad_json(file, field, "expected an object with a string \"type\"");
  return j["type"].get<std::string>();
}

bool get_bool(const json& j, const char* key, bool fallback, const std::string& file,
              const std::string& field) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) bad_json(file, field + "." + key, "expected a boolean");
  return j[key].get<bool>();
}

std::string get_string(const json& j, const char* key, const std::string& file,
                       const std::string& field) {
  if (!j.contains(key) || !j[key].is_string()) bad_json(file, field + "." + key, "expected a string");
  return j[key].get<std::string>();
}

// A Split/Replace pattern: {"Regex": "..."} or {"String": "..."} (literal).
struct Pattern {
  std::unique_ptr<Regex> regex;
  std::string literal;

  Pattern(const json& j, const std::string& file, const std::string& field) {
    if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
      regex = std::make_unique<Regex>(j["Regex"].get<std::string>(), file + ": " + field);
    } else if (j.is_object() && j.contains("String") && j["String"].is_string()) {
      literal = j["String"].get<std::string>();
    } else {
      bad_json(file, field, "expected {\"Regex\": ...} or {\"String\": ...}");
    }
  }

  // Each match as (begin, end), in order, non-overlapping.
  template <class F>
  void for_each_match(std::string_view s, F&& fn) const {
    if (regex) {
      regex->for_each_match(s, fn);
      return;
    }
    if (literal.empty()) return;  // tokenizers: an empty string matches nothing
    size_t pos = 0;
    while ((pos = s.find(literal, pos)) != std::string_view::npos) {
      fn(pos, pos + literal.size());
      pos += literal.size();
    }
  }
};

// Flags each stretch of s as match or not, covering all of it (tokenizers' find_matches).
struct Span {
  size_t begin, end;
  bool match;
};

template <class F>
void find_spans(std::string_view s, std::vector<Span>& spans, F&& for_each_match) {
  spans.clear();
  if (s.empty()) {
    spans.push_back({0, 0, false});
    return;
  }
  size_t prev = 0;
  for_each_match(s, [&](size_t b, size_t e) {
    if (prev != b) spans.push_back({prev, b, false});
    spans.push_back({b, e, true});
    prev = e;
  });
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
}

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

Behavior parse_behavior(const std::string& name, const std::string& file, const std::string& field) {
  if (name == "Removed") return Behavior::removed;
  if (name == "Isolated") return Behavior::isolated;
  if (name == "MergedWithPrevious") return Behavior::merged_with_previous;
  if (name == "MergedWithNext") return Behavior::merged_with_next;
  if (name == "Contiguous") return Behavior::contiguous;
  unsupported(file, field, "split behavior '" + name + "' is not supported");
}

// tokenizers' NormalizedString::split: merges or drops the flagged spans per behavior.
void apply_behavior(std::string_view s, const std::vector<Span>& spans, Behavior behavior,
                    Pieces& out) {
  struct Keep {
    size_t begin, end;
  };
  thread_local std::vector<Keep> keep;
  keep.clear();
  bool previous_match = false;
  switch (behavior) {
    case Behavior::isolated:
      for (const Span& sp : spans) keep.push_back({sp.begin, sp.end});
      break;
    case Behavior::removed:
      for (const Span& sp : spans)
        if (!sp.match) keep.push_back({sp.begin, sp.end});
      break;
    case Behavior::contiguous:
      for (const Span& sp : spans) {
        if (sp.match == previous_match && !keep.empty())
          keep.back().end = sp.end;
        else
          keep.push_back({sp.begin, sp.end});
        previous_match = sp.match;
      }
      break;
    case Behavior::merged_with_previous:
      for (const Span& sp : spans) {
        if (sp.match && !previous_match && !keep.empty())
          keep.back().end = sp.end;
        else
          keep.push_back({sp.begin, sp.end});
        previous_match = sp.match;
      }
      break;
    case Behavior::merged_with_next:
      for (size_t k = spans.size(); k-- > 0;) {
        const Span& sp = spans[k];
        if (sp.match && !previous_match && !keep.empty())
          keep.back().begin = sp.begin;
        else
          keep.push_back({sp.begin, sp.end});
        previous_match = sp.match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
  }
  for (const Keep& k : keep)
    if (k.end > k.begin) out.push_back(s.substr(k.begin, k.end - k.begin));
}

// ---- normalizers ----

class SequenceNormalizer final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> parts;
  void normalize(std::string& s) const override {
    for (const auto& p : parts) p->normalize(s);
  }
};

class PrependNormalizer final : public Normalizer {
 public:
  std::string prefix;
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix);
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(const json& j, const std::string& file)
      : pattern(j.at("pattern"), file, "normalizer Replace.pattern"),
        content(get_string(j, "content", file, "normalizer Replace")) {}
  Pattern pattern;
  std::string content;
  void normalize(std::string& s) const override {
    std::string out;
    size_t prev = 0;
    bool matched = false;
    pattern.for_each_match(s, [&](size_t b, size_t e) {
      out.append(s, prev, b - prev);
      out += content;
      prev = e;
      matched = true;
    });
    if (!matched) return;
    out.append(s, prev, std::string::npos);
    s = std::move(out);
  }
};

class StripNormalizer final : public Normalizer {
 public:
  bool left = true, right = true;
  void normalize(std::string& s) const override {
    size_t b = 0, e = s.size();
    if (left) {
      while (b < e) {
        const Utf8Step st = utf8_step(s, b);
        if (!is_white_space(st.cp)) break;
        b += st.length;
      }
    }
    if (right) {
      while (e > b) {
        size_t k = e - 1;
        while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        if (!is_white_space(utf8_step(s, k).cp)) break;
        e = k;
      }
    }
    s = s.substr(b, e - b);
  }
};

struct LowerRun {
  char32_t first, last;
  int stride, delta;
};
constexpr LowerRun kLowerRuns[] = {
#include "tokenizer/lowercase_table.inc"
};

char32_t simple_lower(char32_t c) {
  const auto* it = std::upper_bound(std::begin(kLowerRuns), std::end(kLowerRuns), c,
                                    [](char32_t v, const LowerRun& r) { return v < r.first; });
  if (it == std::begin(kLowerRuns)) return c;
  const LowerRun& r = *(it - 1);
  if (c > r.last || (c - r.first) % r.stride != 0) return c;
  return static_cast<char32_t>(static_cast<int64_t>(c) + r.delta);
}

// Rust's char::to_lowercase, per character (no final-sigma context, as tokenizers does).
class LowercaseNormalizer final : public Normalizer {
 public:
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      const unsigned char b = static_cast<unsigned char>(s[i]);
      if (b < 0x80) {
        out += static_cast<char>(b >= 'A' && b <= 'Z' ? b + 32 : b);
        ++i;
        continue;
      }
      const Utf8Step st = utf8_step(s, i);
      if (st.cp == 0x130) {
        out += "i\xCC\x87";  // U+0130 lowercases to i + U+0307
      } else {
        append_utf8(out, simple_lower(st.cp));
      }
      i += st.length;
    }
    s = std::move(out);
  }
};

std::unique_ptr<Normalizer> parse_normalizer_at(const json& j, const std::string& file,
                                                const std::string& field) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, file, field);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNormalizer>();
    if (!j.contains("normalizers") || !j["normalizers"].is_array())
      bad_json(file, field + ".normalizers", "expected an array");
    for (const auto& sub : j["normalizers"]) {
      auto n = parse_normalizer_at(sub, file, field);
      if (n) seq->parts.push_back(std::move(n));
    }
    return seq;
  }
  if (type == "Prepend") {
    auto n = std::make_unique<PrependNormalizer>();
    n->prefix = get_string(j, "prepend", file, field);
    return n;
  }
  if (type == "Replace") {
    if (!j.contains("pattern")) bad_json(file, field + ".pattern", "missing");
    return std::make_unique<ReplaceNormalizer>(j, file);
  }
  if (type == "Strip") {
    auto n = std::make_unique<StripNormalizer>();
    n->left = get_bool(j, "strip_left", true, file, field);
    n->right = get_bool(j, "strip_right", true, file, field);
    return n;
  }
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD")
    unsupported(file, field,
                "normalizer '" + type + "' (Unicode normalization) is not supported: keel has no "
                "Unicode decomposition tables");
  unsupported(file, field, "normalizer '" + type + "' is not supported");
}

// ---- pre-tokenizers ----

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(const json& j, const std::string& file, const std::string& field)
      : pattern(j.at("pattern"), file, field + ".pattern"),
        behavior(parse_behavior(get_string(j, "behavior", file, field), file, field + ".behavior")),
        invert(get_bool(j, "invert", false, file, field)) {}
  Pattern pattern;
  Behavior behavior;
  bool invert;

  void split(const Pieces& in, Pieces& out, Arena&) const override {
    out.clear();
    thread_local std::vector<Span> spans;
    for (std::string_view piece : in) {
      find_spans(piece, spans, [&](std::string_view s, auto&& fn) { pattern.for_each_match(s, fn); });
      if (invert)
        for (Span& sp : spans) sp.match = !sp.match;
      apply_behavior(piece, spans, behavior, out);
    }
  }
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual)
      : digit(R"(\p{N})", "pre_tokenizer Digits"),
        behavior(individual ? Behavior::isolated : Behavior::contiguous) {}
  Regex digit;  // Rust's char::is_numeric: general category N
  Behavior behavior;

  void split(const Pieces& in, Pieces& out, Arena&) const override {
    out.clear();
    thread_local std::vector<Span> spans;
    for (std::string_view piece : in) {
      find_spans(piece, spans, [&](std::string_view s, auto&& fn) { digit.for_each_match(s, fn); });
      apply_behavior(piece, spans, behavior, out);
    }
  }
};

// GPT-2's pre-tokenization regex, which ByteLevel uses when use_regex is set.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The splitting half of ByteLevel; the byte -> character mapping is implicit, since the
// model then works on bytes.
class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool prefix_space, bool use_regex) : add_prefix_space(prefix_space) {
    if (use_regex) regex = std::make_unique<Regex>(kGpt2Regex, "pre_tokenizer ByteLevel");
  }
  bool add_prefix_space;
  std::unique_ptr<Regex> regex;

  void split(const Pieces& in, Pieces& out, Arena& arena) const override {
    out.clear();
    for (std::string_view piece : in) {
      if (add_prefix_space && (piece.empty() || piece[0] != ' ')) {
        arena.push_back(" " + std::string(piece));
        piece = arena.back();
      }
      if (!regex) {
        if (!piece.empty()) out.push_back(piece);
        continue;
      }
      thread_local std::vector<Span> spans;
      find_spans(piece, spans, [&](std::string_view s, auto&& fn) { regex->for_each_match(s, fn); });
      apply_behavior(piece, spans, Behavior::isolated, out);
    }
  }
};

void flatten_pre_tokenizer(const json& j, const std::string& file, const std::string& field,
                           std::vector<const json*>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j, file, field);
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      bad_json(file, field + ".pretokenizers", "expected an array");
    for (const auto& sub : j["pretokenizers"]) flatten_pre_tokenizer(sub, file, field, out);
    return;
  }
  out.push_back(&j);
}

}  // namespace

bool is_white_space(char32_t c) {
  return (c >= 0x9 && c <= 0xD) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::unique_ptr<Normalizer> parse_normalizer(const json& j, const std::string& file) {
  return parse_normalizer_at(j, file, "normalizer");
}

PreTokenizerChain parse_pre_tokenizer(const json& j, const std::string& file) {
  std::vector<const json*> flat;
  flatten_pre_tokenizer(j, file, "pre_tokenizer", flat);
  PreTokenizerChain chain;
  for (size_t k = 0; k < flat.size(); ++k) {
    const json& step = *flat[k];
    const std::string field = "pre_tokenizer[" + std::to_string(k) + "]";
    const std::string type = type_of(step, file, field);
    if (type == "Split") {
      if (!step.contains("pattern")) bad_json(file, field + ".pattern", "missing");
      chain.steps.push_back(std::make_unique<SplitPreTokenizer>(step, file, field));
    } else if (type == "Digits") {
      chain.steps.push_back(std::make_unique<DigitsPreTokenizer>(
          get_bool(step, "individual_digits", false, file, field)));
    } else if (type == "ByteLevel") {
      if (k + 1 != flat.size())
        unsupported(file, field,
                    "pre_tokenizer 'ByteLevel' is supported only as the last step (here step " +
                        std::to_string(k) + " of " + std::to_string(flat.size()) + ")");
      chain.steps.push_back(std::make_unique<ByteLevelPreTokenizer>(
          get_bool(step, "add_prefix_space", true, file, field),
          get_bool(step, "use_regex", true, file, field)));
      chain.byte_level = true;
    } else {
      unsupported(file, field, "pre_tokenizer '" + type + "' is not supported");
    }
  }
  return chain;
}

// ---- added tokens ----

int32_t AddedTokenMatcher::child(int32_t node, unsigned char b) const {
  const auto& edges = nodes_[node].edges;
  for (const auto& [byte, next] : edges)
    if (byte == b) return next;
  return -1;
}

void AddedTokenMatcher::add(const std::string& pattern, const AddedToken& token) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (const char ch : pattern) {
    const auto b = static_cast<unsigned char>(ch);
    int32_t next = child(node, b);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      auto& edges = nodes_[node].edges;
      edges.insert(std::upper_bound(edges.begin(), edges.end(), std::make_pair(b, int32_t{-1})),
                   {b, next});
    }
    node = next;
  }
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  // A pattern given twice keeps its first token, as the first pattern of a
  // leftmost-longest automaton wins.
  if (nodes_[node].token >= 0) return;
  nodes_[node].token = static_cast<int32_t>(tokens_.size());
  tokens_.push_back(token);
}

namespace {

const Regex& word_char_regex() {
  // Rust regex \w: Alphabetic, marks, decimal numbers, connector punctuation, joiners.
  static const Regex re(R"([\p{L}\p{M}\p{Nd}\p{Nl}\p{Pc}\x{200C}\x{200D}])", "single_word");
  return re;
}

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t k = s.size() - 1;
  while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
  return word_char_regex().matches_prefix(s.substr(k));
}

bool starts_with_word(std::string_view s) {
  return !s.empty() && word_char_regex().matches_prefix(s.substr(0, utf8_lead_length(s[0])));
}

}  // namespace

void AddedTokenMatcher::split(std::string_view s, std::vector<Segment>& out) const {
  size_t start_offset = 0;
  const auto push_text = [&](size_t b, size_t e) {
    if (e > b) out.push_back({b, e, -1});
  };
  size_t i = 0;
  while (i < s.size()) {
    if (!first_byte_[static_cast<unsigned char>(s[i])]) {
      ++i;
      continue;
    }
    // Longest pattern starting at i.
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t k = i; k < s.size(); ++k) {
      node = child(node, static_cast<unsigned char>(s[k]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) best = nodes_[node].token, best_end = k + 1;
    }
    if (best < 0) {
      ++i;
      continue;
    }
    const AddedToken& tok = tokens_[best];
    size_t start = i, stop = best_end;
    i = best_end;  // matches never overlap, discarded ones included
    if (tok.single_word) {
      const bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
      const bool stop_space = stop == s.size() || !starts_with_word(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t b = start;
      while (b > 0) {
        size_t k = b - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        if (!is_white_space(utf8_step(s, k).cp)) break;
        b = k;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size()) {
        const Utf8Step st = utf8_step(s, stop);
        if (!is_white_space(st.cp)) break;
        stop += st.length;
      }
    }
    push_text(start_offset, start);
    out.push_back({start, stop, tok.id});
    start_offset = stop;
  }
  push_text(start_offset, s.size());
}

}  // namespace keel::tok
