#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "base/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/utf8.h"

namespace keel {
namespace tok {

using nlohmann::json;

enum class DecoderKind { join, byte_level };

struct TokenizerImpl {
  std::string file;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Normalizer> normalizer;
  PreTokenizerChain pre;
  AddedTokenMatcher raw_matcher;         // added tokens matched before normalization
  AddedTokenMatcher normalized_matcher;  // ... and after it
  TokenMap added_by_content;
  std::vector<int32_t> prefix, suffix;   // what add_special_tokens puts around the text
  DecoderKind decoder = DecoderKind::join;

  // Per id: the token's text, what decoding yields for it, whether it is an added token
  // and whether it is special.
  struct IdInfo {
    std::string_view text;
    std::string decoded;
    bool exists = false;
    bool added = false;
    bool special = false;
  };
  std::vector<std::string> added_texts;  // storage for added tokens' text
  std::vector<IdInfo> ids;

  std::optional<int32_t> bos, eos;

  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void model_text(std::string_view text, std::vector<int32_t>& out) const;
};

void TokenizerImpl::model_text(std::string_view text, std::vector<int32_t>& out) const {
  Pieces a{text}, b;
  Arena arena;
  for (const auto& step : pre.steps) {
    step->split(a, b, arena);
    std::swap(a, b);
  }
  for (std::string_view piece : a) model->encode(piece, out);
}

void TokenizerImpl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::string normalized;
  std::string_view n = text;
  if (normalizer) {
    normalized.assign(text);
    normalizer->normalize(normalized);
    n = normalized;
  }
  if (normalized_matcher.empty()) {
    if (!n.empty()) model_text(n, out);
    return;
  }
  std::vector<Segment> segs;
  normalized_matcher.split(n, segs);
  for (const Segment& s : segs) {
    if (s.id >= 0)
      out.push_back(s.id);
    else
      model_text(n.substr(s.begin, s.end - s.begin), out);
  }
}

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, {.file = path}, "cannot open");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(ErrorCode::io, {.file = path}, "read failed");
  return text;
}

json parse_json(std::string_view text, const std::string& file) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail(ErrorCode::tokenizer_json, {.file = file}, std::string("not valid JSON: ") + e.what());
  }
}

[[noreturn]] void bad(const std::string& file, const std::string& field, const std::string& msg) {
  fail(ErrorCode::tokenizer_json, {.file = file, .field = field}, msg);
}

[[noreturn]] void unsupported(const std::string& file, const std::string& field,
                              const std::string& msg) {
  fail(ErrorCode::tokenizer_unsupported, {.file = file, .field = field}, msg);
}

bool flag(const json& j, const char* key, bool fallback, const std::string& file,
          const std::string& field) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) bad(file, field + "." + key, "expected a boolean");
  return j[key].get<bool>();
}

std::string type_of(const json& j, const std::string& file, const std::string& field) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    bad(file, field, "expected an object with a string \"type\"");
  return j["type"].get<std::string>();
}

std::vector<AddedToken> parse_added_tokens(const json& root, const std::string& file) {
  std::vector<AddedToken> out;
  if (!root.contains("added_tokens") || root["added_tokens"].is_null()) return out;
  const json& list = root["added_tokens"];
  if (!list.is_array()) bad(file, "added_tokens", "expected an array");
  for (size_t k = 0; k < list.size(); ++k) {
    const json& t = list[k];
    const std::string field = "added_tokens[" + std::to_string(k) + "]";
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        !t.contains("content") || !t["content"].is_string())
      bad(file, field, "expected an object with an integer \"id\" and a string \"content\"");
    AddedToken a;
    a.id = t["id"].get<int32_t>();
    if (a.id < 0 || a.id >= (1 << 30)) bad(file, field + ".id", "out of range");
    a.content = t["content"].get<std::string>();
    a.special = flag(t, "special", false, file, field);
    a.normalized = flag(t, "normalized", !a.special, file, field);
    a.lstrip = flag(t, "lstrip", false, file, field);
    a.rstrip = flag(t, "rstrip", false, file, field);
    a.single_word = flag(t, "single_word", false, file, field);
    out.push_back(std::move(a));
  }
  return out;
}

DecoderKind parse_decoder(const json& j, const std::string& file, const std::string& field) {
  if (j.is_null()) return DecoderKind::join;
  const std::string type = type_of(j, file, field);
  if (type == "ByteLevel") return DecoderKind::byte_level;
  if (type == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array())
      bad(file, field + ".decoders", "expected an array");
    std::optional<DecoderKind> kind;
    for (size_t k = 0; k < j["decoders"].size(); ++k) {
      const DecoderKind d = parse_decoder(j["decoders"][k], file, field + "[" + std::to_string(k) + "]");
      if (d == DecoderKind::join) continue;
      kind = d;
    }
    return kind.value_or(DecoderKind::join);
  }
  unsupported(file, field, "decoder '" + type + "' is not supported");
}

// The single-sequence part of a post_processor: special ids before and after the text.
void parse_post_processor(const json& j, const std::string& file, const std::string& field,
                          std::vector<int32_t>& prefix, std::vector<int32_t>& suffix) {
  if (j.is_null()) return;
  const std::string type = type_of(j, file, field);
  const auto id_of = [&](const json& pair, const std::string& f) {
    if (!pair.is_array() || pair.size() != 2 || !pair[1].is_number_integer())
      bad(file, f, "expected [token, id]");
    return pair[1].get<int32_t>();
  };
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    if (!j.contains("processors") || !j["processors"].is_array())
      bad(file, field + ".processors", "expected an array");
    for (size_t k = 0; k < j["processors"].size(); ++k)
      parse_post_processor(j["processors"][k], file, field + "[" + std::to_string(k) + "]", prefix,
                           suffix);
    return;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    prefix.push_back(id_of(j.value("cls", json()), field + ".cls"));
    suffix.insert(suffix.begin(), id_of(j.value("sep", json()), field + ".sep"));
    return;
  }
  if (type == "TemplateProcessing") {
    if (!j.contains("single") || !j["single"].is_array())
      bad(file, field + ".single", "expected an array");
    const json& specials = j.value("special_tokens", json::object());
    bool seen_sequence = false;
    std::vector<int32_t> before, after;
    for (const json& item : j["single"]) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
        bad(file, field + ".single", "expected Sequence or SpecialToken items");
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array())
        bad(file, field + ".special_tokens", "no ids for special token '" + name + "'");
      for (const json& id : specials[name]["ids"]) (seen_sequence ? after : before).push_back(id.get<int32_t>());
    }
    prefix.insert(prefix.end(), before.begin(), before.end());
    suffix.insert(suffix.begin(), after.begin(), after.end());
    return;
  }
  unsupported(file, field, "post_processor '" + type + "' is not supported");
}

// tokenizer_config.json spells a token as a string or as an AddedToken object.
std::optional<std::string> config_token(const json& config, const char* key, const std::string& file) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  bad(file, key, "expected a string or an object with \"content\"");
}

std::shared_ptr<const TokenizerImpl> build(std::string_view tokenizer_json, std::string_view config_text,
                                           const std::string& file, const std::string& config_file) {
  const json root = parse_json(tokenizer_json, file);
  if (!root.is_object()) bad(file, "", "expected a JSON object");
  auto impl = std::make_shared<TokenizerImpl>();
  impl->file = file;

  if (root.contains("truncation") && !root["truncation"].is_null())
    unsupported(file, "truncation", "truncation is not supported");
  if (root.contains("padding") && !root["padding"].is_null())
    unsupported(file, "padding", "padding is not supported");

  impl->normalizer = parse_normalizer(root.value("normalizer", json()), file);
  impl->pre = parse_pre_tokenizer(root.value("pre_tokenizer", json()), file);
  if (!root.contains("model")) bad(file, "model", "missing");
  impl->model = std::make_unique<BpeModel>(root["model"], impl->pre.byte_level, file);
  impl->decoder = parse_decoder(root.value("decoder", json()), file, "decoder");

  // Added tokens: matched in the raw text (normalized false) or in the normalized text
  // (normalized true, against the normalized content); special ones come first, as in
  // tokenizers' AddedVocabulary.
  const std::vector<AddedToken> added = parse_added_tokens(root, file);
  for (int pass = 0; pass < 2; ++pass) {
    for (const AddedToken& a : added) {
      if (a.special != (pass == 0) || a.content.empty()) continue;
      if (a.normalized) {
        std::string pattern = a.content;
        if (impl->normalizer) impl->normalizer->normalize(pattern);
        impl->normalized_matcher.add(pattern, a);
      } else {
        impl->raw_matcher.add(a.content, a);
      }
    }
  }

  const auto& model_tokens = impl->model->tokens();
  size_t size = model_tokens.size();
  for (const AddedToken& a : added) size = std::max(size, static_cast<size_t>(a.id) + 1);
  impl->ids.resize(size);
  for (size_t id = 0; id < model_tokens.size(); ++id) {
    if (model_tokens[id].empty() && !impl->model->id(model_tokens[id])) continue;
    auto& info = impl->ids[id];
    info.exists = true;
    info.text = model_tokens[id];
  }
  impl->added_texts.reserve(added.size());
  for (const AddedToken& a : added) {
    impl->added_texts.push_back(a.content);
    impl->added_by_content.emplace(a.content, a.id);
  }
  for (size_t k = 0; k < added.size(); ++k) {
    auto& info = impl->ids[added[k].id];
    info.exists = info.added = true;
    info.special = added[k].special;
    info.text = impl->added_texts[k];
  }
  // Decoding spells a normalized added token in its normalized form, then sends every
  // token through the decoder (tokenizers' simple_id_to_token).
  for (const AddedToken& a : added) {
    std::string text = a.content;
    if (a.normalized && impl->normalizer) impl->normalizer->normalize(text);
    impl->ids[a.id].decoded = std::move(text);
  }
  for (auto& info : impl->ids) {
    if (!info.exists) continue;
    if (!info.added) info.decoded = info.text;
    if (impl->decoder == DecoderKind::join) continue;
    // ByteLevel: a token made only of byte characters stands for those bytes; any other
    // token stands for its own UTF-8 text.
    std::string raw;
    bool ok = true;
    for (size_t i = 0; i < info.decoded.size() && ok;) {
      const Utf8Step st = utf8_step(info.decoded, i);
      const int byte = st.valid ? byte_of_char(st.cp) : -1;
      ok = byte >= 0;
      raw += static_cast<char>(byte);
      i += st.length;
    }
    if (ok) info.decoded = std::move(raw);
  }

  parse_post_processor(root.value("post_processor", json()), file, "post_processor", impl->prefix,
                       impl->suffix);

  if (!config_text.empty()) {
    const json config = parse_json(config_text, config_file);
    if (!config.is_object()) bad(config_file, "", "expected a JSON object");
    const auto resolve = [&](const char* key) -> std::optional<int32_t> {
      const auto text = config_token(config, key, config_file);
      if (!text) return std::nullopt;
      if (auto it = impl->added_by_content.find(*text); it != impl->added_by_content.end()) return it->second;
      if (auto id = impl->model->id(*text)) return id;
      bad(config_file, key, "token '" + *text + "' is not in the vocabulary");
    };
    impl->bos = resolve("bos_token");
    impl->eos = resolve("eos_token");
    // transformers' Llama-style tokenizers rebuild the template from these two flags.
    if (config.contains("add_bos_token") || config.contains("add_eos_token")) {
      const bool add_bos = flag(config, "add_bos_token", false, config_file, "");
      const bool add_eos = flag(config, "add_eos_token", false, config_file, "");
      impl->prefix.clear();
      impl->suffix.clear();
      if (add_bos) {
        if (!impl->bos) bad(config_file, "add_bos_token", "set, but there is no bos_token");
        impl->prefix.push_back(*impl->bos);
      }
      if (add_eos) {
        if (!impl->eos) bad(config_file, "add_eos_token", "set, but there is no eos_token");
        impl->suffix.push_back(*impl->eos);
      }
    }
  }
  for (const int32_t id : impl->prefix)
    if (id < 0 || static_cast<size_t>(id) >= impl->ids.size() || !impl->ids[id].exists)
      bad(file, "post_processor", "special id " + std::to_string(id) + " names no token");
  for (const int32_t id : impl->suffix)
    if (id < 0 || static_cast<size_t>(id) >= impl->ids.size() || !impl->ids[id].exists)
      bad(file, "post_processor", "special id " + std::to_string(id) + " names no token");
  return impl;
}

// Appends the complete UTF-8 of `bytes` to out and leaves an incomplete final
// character in `bytes`; invalid subparts become U+FFFD.
void drain_utf8(std::string& bytes, std::string& out) {
  size_t i = 0;
  while (i < bytes.size()) {
    const Utf8Step st = utf8_step(bytes, i);
    if (st.valid) {
      out.append(bytes, i, st.length);
    } else if (st.truncated) {
      break;
    } else {
      out.append(kReplacementChar);
    }
    i += st.length;
  }
  bytes.erase(0, i);
}

}  // namespace
}  // namespace tok

Tokenizer Tokenizer::load(const std::string& tokenizer_json_path) {
  const auto config = std::filesystem::path(tokenizer_json_path).parent_path() / "tokenizer_config.json";
  return load(tokenizer_json_path, std::filesystem::exists(config) ? config.string() : std::string());
}

Tokenizer Tokenizer::load(const std::string& tokenizer_json_path, const std::string& config_path) {
  const std::string text = tok::read_text_file(tokenizer_json_path);
  const std::string config = config_path.empty() ? std::string() : tok::read_text_file(config_path);
  return Tokenizer(tok::build(text, config, tokenizer_json_path, config_path));
}

Tokenizer Tokenizer::from_model_dir(const std::string& dir) {
  return load((std::filesystem::path(dir) / "tokenizer.json").string());
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& name) {
  return Tokenizer(tok::build(tokenizer_json, config_json, name, name + " (config)"));
}

void Tokenizer::encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& out) const {
  const tok::TokenizerImpl& t = *impl_;
  std::string repaired;
  if (!tok::utf8_valid(text)) {
    repaired = tok::utf8_sanitize(text);
    text = repaired;
  }
  if (add_special_tokens) out.insert(out.end(), t.prefix.begin(), t.prefix.end());
  if (t.raw_matcher.empty()) {
    if (!text.empty()) t.encode_text(text, out);
  } else {
    std::vector<tok::Segment> segs;
    t.raw_matcher.split(text, segs);
    for (const tok::Segment& s : segs) {
      if (s.id >= 0)
        out.push_back(s.id);
      else
        t.encode_text(text.substr(s.begin, s.end - s.begin), out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode(text, add_special_tokens, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  StreamDecoder stream(*this, skip_special);
  std::string out;
  for (const int32_t id : ids) stream.push(id, out);
  out += stream.flush();
  return out;
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  return impl_->model->id(token);
}

std::string_view Tokenizer::token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->ids.size()) return {};
  return impl_->ids[id].text;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->ids.size()); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->ids.size() && impl_->ids[id].special;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
bool Tokenizer::add_bos() const { return impl_->bos && !impl_->prefix.empty() && impl_->prefix.front() == *impl_->bos; }

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : impl_(tokenizer.impl_), skip_special_(skip_special) {}

void StreamDecoder::push(int32_t id, std::string& out) {
  const tok::TokenizerImpl& t = *impl_;
  if (id < 0 || static_cast<size_t>(id) >= t.ids.size()) return;
  const auto& info = t.ids[id];
  if (!info.exists || (skip_special_ && info.special)) return;
  if (t.decoder == tok::DecoderKind::join) {
    // No decoder: tokenizers joins the tokens with spaces.
    if (!first_) out += ' ';
    out += info.decoded;
    first_ = false;
    return;
  }
  pending_ += info.decoded;
  tok::drain_utf8(pending_, out);
}

std::string StreamDecoder::push(int32_t id) {
  std::string out;
  push(id, out);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  if (!pending_.empty()) out.append(tok::kReplacementChar);  // one truncated character
  pending_.clear();
  first_ = true;
  return out;
}

}  // namespace keel
