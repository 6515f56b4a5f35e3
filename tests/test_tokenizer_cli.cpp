// `keel tokenize` end to end: JSON Lines in, ids out (and --decode back), against the
// tokenizers fixture.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "testing.h"

namespace keel {
namespace {

const std::string kDir = std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/tokenizer/";
const std::string kKeel = std::string(KEEL_BINARY_DIR) + "/keel";

std::string run(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

TEST(TokenizeCommand, EncodesAndDecodesTheFixture) {
  testing::TempDir dir("tokenize-cli");
  std::ifstream in(kDir + "expected_deepseek-v3.jsonl");
  std::string line, texts, expected_ids, expected_special, ids_in, expected_text;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("text")) continue;
    texts += nlohmann::json(j["text"]).dump() + "\n";
    std::string ids, special = "0";
    for (const auto& id : j["ids"]) {
      ids += (ids.empty() ? "" : " ") + std::to_string(id.get<int>());
      special += " " + std::to_string(id.get<int>());
    }
    expected_ids += ids + "\n";
    expected_special += special + "\n";
    ids_in += ids + "\n";
    expected_text += nlohmann::json(j["decoded"]).dump() + "\n";  // decoded skipping specials
  }
  testing::write_file(dir.file("in.jsonl"), texts);
  testing::write_file(dir.file("ids.txt"), ids_in);
  const std::string tok = " --tokenizer " + kDir + "deepseek-v3/tokenizer.json";
  int status = -1;
  EXPECT_EQ(run(kKeel + " tokenize" + tok + " < " + dir.file("in.jsonl"), &status), expected_ids);
  EXPECT_EQ(status, 0);
  // tokenizer_config.json beside the file: --add-special prepends BOS (id 0).
  EXPECT_EQ(run(kKeel + " tokenize --add-special" + tok + " < " + dir.file("in.jsonl"), &status),
            expected_special);
  EXPECT_EQ(run(kKeel + " tokenize --decode --skip-special" + tok + " < " + dir.file("ids.txt"), &status), expected_text);
  EXPECT_EQ(status, 0);
  // Bad input: exit status 2 and a message naming the line.
  testing::write_file(dir.file("bad.jsonl"), "\"ok\"\n42\n");
  const std::string err = run(kKeel + " tokenize" + tok + " < " + dir.file("bad.jsonl") + " 2>&1", &status);
  EXPECT_NE(err.find("stdin line 2"), std::string::npos) << err;
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

}  // namespace
}  // namespace keel
