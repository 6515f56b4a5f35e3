// The text stages of a Hugging Face tokenizer.json before the model: added-token
// matching, normalizers and pre-tokenizers, each as tokenizers defines it.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace keel::tok {

// ---- added tokens ----------------------------------------------------------------

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = true;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A piece of input: text (id < 0) or an added token, as a byte range of the string split.
struct Segment {
  size_t begin, end;
  int32_t id;
};

// Finds added tokens in text: leftmost-longest, non-overlapping, then single_word /
// lstrip / rstrip applied to each match exactly as tokenizers' AddedVocabulary does.
class AddedTokenMatcher {
 public:
  // `pattern` is what is searched for (the content, normalized for normalized tokens).
  void add(const std::string& pattern, const AddedToken& token);
  bool empty() const { return tokens_.empty(); }
  // Appends segments covering s (empty text segments are left out).
  void split(std::string_view s, std::vector<Segment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> edges;  // sorted by byte
    int32_t token = -1;                                    // index into tokens_
  };
  int32_t child(int32_t node, unsigned char b) const;
  std::vector<Node> nodes_{Node{}};
  std::vector<AddedToken> tokens_;
  bool first_byte_[256] = {};
};

// ---- normalizers -------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s) const = 0;
};

// nullptr for a JSON null. Unknown or unsupported types are a keel::Error naming them.
std::unique_ptr<Normalizer> parse_normalizer(const nlohmann::json& j, const std::string& file);

// ---- pre-tokenizers ----------------------------------------------------------------

// Pieces are views into the normalized text or into the arena (for added prefixes).
using Pieces = std::vector<std::string_view>;
using Arena = std::deque<std::string>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits each piece of `in` into `out` (which it clears), leaving out empty pieces.
  virtual void split(const Pieces& in, Pieces& out, Arena& arena) const = 0;
};

struct PreTokenizerChain {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  // A final ByteLevel step: the model then works on raw bytes (each byte a symbol).
  bool byte_level = false;
};

PreTokenizerChain parse_pre_tokenizer(const nlohmann::json& j, const std::string& file);

// Character predicates with Rust's definitions (char::is_whitespace, regex \w).
bool is_white_space(char32_t c);

}  // namespace keel::tok
