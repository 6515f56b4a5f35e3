// The tokenizer against Hugging Face tokenizers 0.23.2: every corpus line of
// tests/fixtures/tokenizer/ for the DeepSeek-V3 tokenizer.json and four synthetic ones
// (ids with and without special tokens, decode, decode skipping specials), random-id
// decodes, the streaming decoder, the invalid-UTF-8 rule, concurrency and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "base/error.h"
#include "testing.h"
#include "tokenizer/bpe.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace keel {
namespace {

using nlohmann::json;

const std::string kDir = std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/tokenizer/";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

struct Case {
  std::string label;
  std::string text;  // raw bytes as fed to keel (possibly invalid UTF-8)
  bool is_encode = false;
  std::vector<int32_t> ids, ids_special, decode_ids;
  std::string decoded, decoded_skip;
};

std::vector<Case> load_cases(const std::string& name) {
  std::vector<Case> cases;
  std::istringstream in(read_text(kDir + "expected_" + name + ".jsonl"));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    Case c;
    c.label = name + " line " + std::to_string(++n);
    if (j.contains("decode_ids")) {
      c.decode_ids = j["decode_ids"].get<std::vector<int32_t>>();
    } else {
      c.is_encode = true;
      c.text = j.contains("hex") ? from_hex(j["hex"].get<std::string>()) : j["text"].get<std::string>();
      c.ids = j["ids"].get<std::vector<int32_t>>();
      c.ids_special = j["ids_special"].get<std::vector<int32_t>>();
    }
    c.decoded = j["decoded"].get<std::string>();
    c.decoded_skip = j["decoded_skip"].get<std::string>();
    cases.push_back(std::move(c));
  }
  return cases;
}

const Tokenizer& deepseek_raw() {  // tokenizer.json alone, as the tokenizers library reads it
  static const Tokenizer t = Tokenizer::load(kDir + "deepseek-v3/tokenizer.json", "");
  return t;
}

const Tokenizer& deepseek() {  // with tokenizer_config.json beside it
  static const Tokenizer t = Tokenizer::load(kDir + "deepseek-v3/tokenizer.json");
  return t;
}

Tokenizer synthetic(const std::string& name) {
  return Tokenizer::load(kDir + "synthetic/" + name + ".json", "");
}

// Checks every case; returns the number of encode lines whose ids all matched.
size_t check_parity(const Tokenizer& tok, const std::vector<Case>& cases) {
  size_t matched = 0, encodes = 0;
  for (const Case& c : cases) {
    if (c.is_encode) {
      ++encodes;
      const auto ids = tok.encode(c.text, false);
      const auto ids_special = tok.encode(c.text, true);
      EXPECT_EQ(ids, c.ids) << c.label << ": " << c.text;
      EXPECT_EQ(ids_special, c.ids_special) << c.label << ": " << c.text;
      EXPECT_EQ(tok.decode(c.ids, true), c.decoded) << c.label;
      EXPECT_EQ(tok.decode(c.ids_special, true), c.decoded_skip) << c.label;
      if (std::none_of(c.ids.begin(), c.ids.end(), [&](int32_t id) { return tok.is_special(id); }))
        EXPECT_EQ(tok.decode(c.ids, false), c.decoded) << c.label;
      if (ids == c.ids && ids_special == c.ids_special) ++matched;
    } else {
      EXPECT_EQ(tok.decode(c.decode_ids, true), c.decoded) << c.label;
      EXPECT_EQ(tok.decode(c.decode_ids, true), c.decoded_skip) << c.label;
      if (std::none_of(c.decode_ids.begin(), c.decode_ids.end(), [&](int32_t id) { return tok.is_special(id); }))
        EXPECT_EQ(tok.decode(c.decode_ids, false), c.decoded) << c.label;
    }
  }
  EXPECT_GT(encodes, 250u);
  return matched;
}

TEST(TokenizerParity, DeepSeekV3AllLines) {
  const auto cases = load_cases("deepseek-v3");
  const size_t matched = check_parity(deepseek_raw(), cases);
  std::printf("deepseek-v3: %zu encode lines matched id for id\n", matched);
}

TEST(TokenizerParity, Synthetic) {
  for (const char* name : {"a_normalize", "b_splits", "c_chars_fallback", "d_chars_unk"}) {
    SCOPED_TRACE(name);
    const size_t matched = check_parity(synthetic(name), load_cases(name));
    std::printf("%s: %zu encode lines matched id for id\n", name, matched);
  }
}

TEST(Tokenizer, DeepSeekConfigAddsBos) {
  const Tokenizer& tok = deepseek();
  // tokenizer_config.json: bos <｜begin▁of▁sentence｜> (id 0), eos <｜end▁of▁sentence｜>
  // (id 1), add_bos_token true, add_eos_token false.
  ASSERT_EQ(tok.bos_id(), 0);
  ASSERT_EQ(tok.eos_id(), 1);
  EXPECT_TRUE(tok.add_bos());
  EXPECT_FALSE(deepseek_raw().add_bos());
  for (const Case& c : load_cases("deepseek-v3")) {
    if (!c.is_encode) continue;
    std::vector<int32_t> expected{0};
    expected.insert(expected.end(), c.ids.begin(), c.ids.end());
    EXPECT_EQ(tok.encode(c.text, true), expected) << c.label;
    EXPECT_EQ(tok.encode(c.text, false), c.ids) << c.label;
  }
  EXPECT_EQ(Tokenizer::from_model_dir(kDir + "deepseek-v3").encode("hi", true), tok.encode("hi", true));
}

TEST(Tokenizer, DeepSeekVocabulary) {
  const Tokenizer& tok = deepseek();
  EXPECT_EQ(tok.vocab_size(), 128815);  // 128,000 BPE entries + added tokens to 128,814
  EXPECT_EQ(tok.token_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok.token(128803), "<｜User｜>");
  EXPECT_EQ(tok.token_id("Ġthe"), 270);
  EXPECT_EQ(tok.token(270), "Ġthe");
  EXPECT_FALSE(tok.token_id("no such token"));
  EXPECT_EQ(tok.token(-1), "");
  EXPECT_EQ(tok.token(200000), "");
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(128803));  // chat tokens are added but not special
  for (int32_t id = 0; id < tok.vocab_size(); id += 97) {
    const auto t = tok.token(id);
    ASSERT_FALSE(t.empty()) << id;
    EXPECT_EQ(tok.token_id(t), id) << id;
  }
  // Ids past the vocabulary decode to nothing, as in tokenizers.
  const std::vector<int32_t> ids{19923, 129000, -5, 2058};
  EXPECT_EQ(tok.decode(ids), "Hello world");
}

TEST(Tokenizer, InvalidUtf8Rule) {
  // Expected strings are Python's bytes.decode("utf-8", "replace").
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(tok::utf8_sanitize("abc\xFF" "def"), "abc" + r + "def");
  EXPECT_EQ(tok::utf8_sanitize("\xE2\x82("), r + "(");
  EXPECT_EQ(tok::utf8_sanitize("\xF0\x9F\x98"), r);
  EXPECT_EQ(tok::utf8_sanitize("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(tok::utf8_sanitize("\xC0\x80"), r + r);
  EXPECT_EQ(tok::utf8_sanitize("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(tok::utf8_sanitize("\xE0\xA0\x80"), "\xE0\xA0\x80");
  EXPECT_TRUE(tok::utf8_valid("\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(tok::utf8_valid("abcdefgh\x80"));
  // encode(bytes) == encode(repaired text).
  const Tokenizer& tok = deepseek_raw();
  EXPECT_EQ(tok.encode("x\xE4\xB8\xAD\xE6\x96 y"), tok.encode("x\xE4\xB8\xAD" + r + " y"));
}

// Streaming: every push is valid UTF-8, and all pushes + flush equal decode().
void check_stream(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip, const std::string& label) {
  StreamDecoder stream(tok, skip);
  std::string all;
  for (const int32_t id : ids) {
    const std::string piece = stream.push(id);
    ASSERT_TRUE(tok::utf8_valid(piece)) << label;
    all += piece;
  }
  all += stream.flush();
  ASSERT_EQ(all, tok.decode(ids, skip)) << label;
}

TEST(StreamDecoder, EqualsDecodeOnEveryFixture) {
  size_t sequences = 0;
  for (const char* name : {"deepseek-v3", "a_normalize", "b_splits", "c_chars_fallback", "d_chars_unk"}) {
    const Tokenizer tok = std::string(name) == "deepseek-v3" ? deepseek_raw() : synthetic(name);
    for (const Case& c : load_cases(name)) {
      const auto& ids = c.is_encode ? c.ids_special : c.decode_ids;
      check_stream(tok, ids, false, c.label);
      check_stream(tok, ids, true, c.label);
      ++sequences;
    }
  }
  EXPECT_GT(sequences, 1500u);
}

TEST(StreamDecoder, SplitsMultiByteCharacters) {
  const Tokenizer& tok = deepseek_raw();
  // "😀" encodes as two byte-level tokens, neither a whole character.
  const auto ids = tok.encode("😀");
  ASSERT_EQ(ids.size(), 2u);
  StreamDecoder s(tok);
  EXPECT_EQ(s.push(ids[0]), "");
  EXPECT_EQ(s.push(ids[1]), "😀");
  EXPECT_EQ(s.flush(), "");
  // A dangling partial character becomes one U+FFFD at the end, like decode().
  EXPECT_EQ(s.push(ids[0]), "");
  EXPECT_EQ(s.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ids[0]}), "\xEF\xBF\xBD");
  // Random id sequences from the whole vocabulary.
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> any(0, tok.vocab_size() - 1);
  for (int k = 0; k < 300; ++k) {
    std::vector<int32_t> seq(1 + rng() % 40);
    for (auto& id : seq) id = any(rng);
    check_stream(tok, seq, k % 2 == 0, "random " + std::to_string(k));
  }
  // Text of CJK, emoji and ZWJ sequences, pushed id by id.
  const auto text = tok.encode("中文😀👨‍👩‍👧‍👦 مرحبا 日本語 🇯🇵 x");
  check_stream(tok, text, false, "mixed");
}

TEST(Tokenizer, ConcurrentEncodeMatchesSerial) {
  const Tokenizer tok = Tokenizer::load(kDir + "deepseek-v3/tokenizer.json", "");  // cold cache
  const auto cases = load_cases("deepseek-v3");
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = t; i < cases.size() + t; ++i) {
          const Case& c = cases[(i * 7 + round) % cases.size()];
          if (c.is_encode && tok.encode(c.text) != c.ids) ++mismatches;
        }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Bpe, HeapAndLinearMergesAgree) {
  const json root = json::parse(read_text(kDir + "deepseek-v3/tokenizer.json"));
  const tok::BpeModel model(root["model"], true, "tokenizer.json");
  std::mt19937 rng(9);
  const std::string alphabet = "aeioustnrl ";
  for (int k = 0; k < 300; ++k) {
    std::string piece;
    const size_t n = 1 + rng() % 120;
    for (size_t i = 0; i < n; ++i) piece += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(model.merge_for_test(piece, true), model.merge_for_test(piece, false)) << piece;
  }
  // The cached path gives the same as a fresh merge.
  std::vector<int32_t> a, b;
  model.encode("internationalization", a);
  model.encode("internationalization", b);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, model.merge_for_test("internationalization", false));
}

TEST(Regex, OnigurumaClasses) {
  // Oniguruma's \s includes U+0085 (NEL); PCRE2's does not, so it is rewritten.
  const tok::Regex space(R"(\s+)", "test");
  std::vector<std::pair<size_t, size_t>> m;
  space.for_each_match("a\xC2\x85" "b", [&](size_t b, size_t e) { m.emplace_back(b, e); });
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0], std::make_pair(size_t{1}, size_t{3}));
  // \h is a hex digit in Oniguruma.
  const tok::Regex hex(R"(\h+)", "test");
  m.clear();
  hex.for_each_match("zz0fA9 q", [&](size_t b, size_t e) { m.emplace_back(b, e); });
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0], std::make_pair(size_t{2}, size_t{6}));
  // Empty matches step one character, never touching the previous match.
  const tok::Regex star("x*", "test");
  m.clear();
  star.for_each_match("axxb", [&](size_t b, size_t e) { m.emplace_back(b, e); });
  const std::vector<std::pair<size_t, size_t>> expected{{0, 0}, {1, 3}, {4, 4}};
  EXPECT_EQ(m, expected);
}

std::string with(const std::string& json_text, const std::string& key, const std::string& value) {
  json j = json::parse(json_text);
  j[key] = json::parse(value);
  return j.dump();
}

TEST(Tokenizer, UnsupportedComponentsAreNamed) {
  const std::string base = read_text(kDir + "synthetic/a_normalize.json");
  const auto unsupported = [&](const std::string& key, const std::string& value, const std::string& name) {
    const std::string msg = KEEL_EXPECT_ERROR(Tokenizer::from_json(with(base, key, value)),
                                              ErrorCode::tokenizer_unsupported);
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
  };
  unsupported("normalizer", R"({"type": "NFC"})", "'NFC'");
  unsupported("normalizer", R"({"type": "Sequence", "normalizers": [{"type": "NFKC"}]})", "'NFKC'");
  unsupported("normalizer", R"({"type": "BertNormalizer"})", "'BertNormalizer'");
  unsupported("pre_tokenizer", R"({"type": "Whitespace"})", "'Whitespace'");
  unsupported("pre_tokenizer",
              R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]})",
              "'ByteLevel'");
  unsupported("decoder", R"({"type": "WordPiece"})", "'WordPiece'");
  unsupported("post_processor", R"({"type": "Mystery"})", "'Mystery'");
  unsupported("truncation", R"({"max_length": 5})", "truncation");
  json j = json::parse(base);
  j["model"]["type"] = "Unigram";
  std::string msg = KEEL_EXPECT_ERROR(Tokenizer::from_json(j.dump()), ErrorCode::tokenizer_unsupported);
  EXPECT_NE(msg.find("Unigram"), std::string::npos) << msg;
}

TEST(Tokenizer, MalformedJsonIsAnError) {
  const std::string base = read_text(kDir + "synthetic/a_normalize.json");
  KEEL_EXPECT_ERROR(Tokenizer::from_json("{not json"), ErrorCode::tokenizer_json);
  KEEL_EXPECT_ERROR(Tokenizer::from_json("[]"), ErrorCode::tokenizer_json);
  json j = json::parse(base);
  j["model"]["merges"].push_back("nosuchtoken Ġ");
  std::string msg = KEEL_EXPECT_ERROR(Tokenizer::from_json(j.dump()), ErrorCode::tokenizer_json);
  EXPECT_NE(msg.find("nosuchtoken"), std::string::npos) << msg;
  j = json::parse(base);
  j["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"})");
  msg = KEEL_EXPECT_ERROR(Tokenizer::from_json(j.dump()), ErrorCode::tokenizer_json);
  EXPECT_NE(msg.find("(unclosed"), std::string::npos) << msg;
  j = json::parse(base);
  j["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"})");
  KEEL_EXPECT_ERROR(Tokenizer::from_json(j.dump()), ErrorCode::tokenizer_unsupported);
  KEEL_EXPECT_ERROR(Tokenizer::load(kDir + "no-such-file.json"), ErrorCode::io);
}

}  // namespace
}  // namespace keel
