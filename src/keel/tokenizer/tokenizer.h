// Byte-level BPE tokenizers from a Hugging Face tokenizer.json (the DeepSeek family),
// id for id with the tokenizers library, and an incremental detokenizer for streaming.
//
// Input text that is not valid UTF-8 is first repaired: each maximal invalid subpart
// becomes U+FFFD, exactly as Python's bytes.decode("utf-8", "replace") does, so
// encode(bytes) == HF encode(bytes.decode("utf-8", "replace")).
//
// decode() returns valid UTF-8: the decoded bytes with the same replacement rule applied
// (tokenizers' String::from_utf8_lossy). Ids that name no token are skipped, as
// tokenizers does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

namespace tok {
struct TokenizerImpl;
}

class Tokenizer {
 public:
  // tokenizer.json, plus tokenizer_config.json from the same directory when present.
  static Tokenizer load(const std::string& tokenizer_json_path);
  // config_path "" reads no tokenizer_config.json: add_special_tokens then follows the
  // tokenizer.json post_processor alone (what the tokenizers library does).
  static Tokenizer load(const std::string& tokenizer_json_path, const std::string& config_path);
  // DIR/tokenizer.json (+ DIR/tokenizer_config.json when present).
  static Tokenizer from_model_dir(const std::string& dir);
  // From JSON text; `name` stands for the file in errors.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             const std::string& name = "tokenizer.json");

  // Thread-safe. add_special_tokens adds what the post-processor adds: with a
  // tokenizer_config.json that sets add_bos_token / add_eos_token, BOS / EOS around the
  // text (as transformers does); otherwise the tokenizer.json post_processor's template.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  void encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& out) const;

  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  std::optional<int32_t> token_id(std::string_view token) const;  // added tokens first
  std::string_view token(int32_t id) const;                         // "" when none
  // One past the largest id that names a token (BPE vocabulary and added tokens).
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;  // an added token marked special

  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  bool add_bos() const;  // whether add_special_tokens prepends BOS

 private:
  explicit Tokenizer(std::shared_ptr<const tok::TokenizerImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const tok::TokenizerImpl> impl_;
  friend class StreamDecoder;
};

// Turns ids into text one at a time, holding back bytes that do not yet form a complete
// UTF-8 character. Each push returns only valid UTF-8, and the concatenation of all
// pushes and the final flush() equals tokenizer.decode(all ids, skip_special).
// One instance per stream; not thread-safe (streams are independent).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  void push(int32_t id, std::string& out);  // appends to out
  // Ends the stream: any incomplete character becomes U+FFFD. The decoder can be reused.
  std::string flush();

 private:
  std::shared_ptr<const tok::TokenizerImpl> impl_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;
};

}  // namespace keel
