// libFuzzer target: arbitrary bytes -> Tokenizer::encode -> decode. Encoding must not
// fail on any input (invalid UTF-8 included), every id must name a token, the streaming
// decoder must equal decode() and emit only valid UTF-8, and decode(encode(text)) must
// give back the text with invalid UTF-8 repaired (the DeepSeek-V3 tokenizer has an empty
// normalizer and a byte-level pre-tokenizer, so it round-trips exactly).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

#ifndef KEEL_SOURCE_DIR
#define KEEL_SOURCE_DIR "."
#endif

namespace {

const keel::Tokenizer& tokenizer() {
  // The fixture is found from the source tree (replay build) or the working directory.
  static const keel::Tokenizer t = [] {
    const char* env = std::getenv("KEEL_TOKENIZER");
    if (env && *env) return keel::Tokenizer::load(env);
    return keel::Tokenizer::load(std::string(KEEL_SOURCE_DIR) +
                                 "/tests/fixtures/tokenizer/deepseek-v3/tokenizer.json");
  }();
  return t;
}

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const keel::Tokenizer& tok = tokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool add_special = size > 0 && (data[0] & 1);
  const auto ids = tok.encode(text, add_special);
  for (const int32_t id : ids) check(id >= 0 && id < tok.vocab_size() && !tok.token(id).empty());

  const std::string decoded = tok.decode(ids);
  check(keel::tok::utf8_valid(decoded));
  const std::string expected = keel::tok::utf8_sanitize(text);
  const std::string bos = add_special && tok.add_bos() ? std::string(tok.token(*tok.bos_id())) : "";
  check(decoded == bos + expected);

  for (const bool skip : {false, true}) {
    keel::StreamDecoder stream(tok, skip);
    std::string all;
    for (const int32_t id : ids) {
      const std::string piece = stream.push(id);
      check(keel::tok::utf8_valid(piece));
      all += piece;
    }
    all += stream.flush();
    check(all == tok.decode(ids, skip));
  }
  // The raw bytes read as ids (4 bytes each) decode consistently too.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 4 <= size; i += 4) {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v = v << 8 | data[i + k];
    raw.push_back(static_cast<int32_t>(v % static_cast<uint32_t>(tok.vocab_size() + 16)));
  }
  keel::StreamDecoder stream(tok);
  std::string all;
  for (const int32_t id : raw) all += stream.push(id);
  all += stream.flush();
  check(all == tok.decode(raw) && keel::tok::utf8_valid(all));
  return 0;
}
