// keel-tiny-v4 (models/keel-tiny-v4, made by tools/train_tiny.py) against transformers
// 5.17.0 on its dequantized weights (tests/fixtures/keel_tiny_v4_reference.safetensors):
// the logits at every eighth position of a 96-token validation text, the argmax and the
// largest logit at every position, from a full forward, from token-by-token decode and
// from chunked prefill. Also checks that the trained model's tokenizer loads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "model/model.h"
#include "testing.h"
#include "tokenizer/tokenizer.h"

namespace keel {
namespace {

const std::string kModel = std::string(KEEL_SOURCE_DIR) + "/models/keel-tiny-v4";
const std::string kReference = std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/keel_tiny_v4_reference.safetensors";

struct Reference {
  std::vector<int32_t> ids = testing::fixture_ints(kReference, "input_ids"),
                       positions = testing::fixture_ints(kReference, "positions"),
                       argmax = testing::fixture_ints(kReference, "argmax");
  std::vector<float> logits = testing::fixture_floats(kReference, "logits"),  // [positions, vocab]
      max_logit = testing::fixture_floats(kReference, "max_logit");
};

const Model& model() {
  static const std::unique_ptr<Model> m = Model::load(kModel);
  return *m;
}

// transformers ran on a GPU (float32, TF32 off), keel on the CPU: they differ by about
// 1e-5 (max |logit| 17.9). The bound leaves room for other CPUs and compilers.
constexpr double kTolerance = 2e-4;

// Compares [seq, vocab] logits with the reference; returns max |Δ| over the stored rows.
double compare(const Reference& ref, const std::vector<float>& logits, int64_t vocab) {
  const int64_t seq = static_cast<int64_t>(ref.ids.size());
  EXPECT_EQ(static_cast<int64_t>(logits.size()), seq * vocab);
  double worst = 0;
  for (size_t r = 0; r < ref.positions.size(); ++r) {
    const int64_t p = ref.positions[r];
    for (int64_t v = 0; v < vocab; ++v)
      worst = std::max(worst, static_cast<double>(std::fabs(logits[p * vocab + v] - ref.logits[r * vocab + v])));
  }
  int argmax_mismatches = 0;
  double worst_max = 0;
  for (int64_t p = 0; p < seq; ++p) {
    const float* row = logits.data() + p * vocab;
    const int64_t top = std::max_element(row, row + vocab) - row;
    // A near-tie may flip between two float32 implementations; count only clear ones.
    if (top != ref.argmax[p] && std::fabs(row[top] - row[ref.argmax[p]]) > 1e-4) ++argmax_mismatches;
    worst_max = std::max(worst_max, static_cast<double>(std::fabs(row[top] - ref.max_logit[p])));
  }
  EXPECT_EQ(argmax_mismatches, 0);
  EXPECT_LT(worst_max, kTolerance);
  return worst;
}

TEST(KeelTiny, ModelAndTokenizerLoad) {
  const Model& m = model();
  EXPECT_EQ(m.config().vocab_size, 4096);
  EXPECT_EQ(m.config().num_hidden_layers, 6);
  const Tokenizer tok = Tokenizer::from_model_dir(kModel);
  const std::vector<int32_t> ids = tok.encode("In the beginning", /*add_special_tokens=*/true);
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids[0], 0);  // BOS
  EXPECT_EQ(tok.decode(std::span(ids).subspan(1)), "In the beginning");
}

TEST(KeelTiny, FullForwardMatchesTransformers) {
  const Reference ref;
  const Model& m = model();
  Sequence seq = m.new_sequence();
  const auto logits = m.forward(seq, ref.ids);
  const double d = compare(ref, logits, m.config().vocab_size);
  EXPECT_LT(d, kTolerance) << "max |dlogit| " << d;
  std::ostringstream text;
  text << d;
  RecordProperty("max_abs_diff", text.str());
}

TEST(KeelTiny, DecodeAndChunksMatchTransformers) {
  const Reference ref;
  const Model& m = model();
  const int64_t V = m.config().vocab_size;
  // Prefill 7 tokens, then one at a time.
  std::vector<float> decoded;
  Sequence seq = m.new_sequence();
  const std::span<const int32_t> ids(ref.ids);
  auto part = m.forward(seq, ids.subspan(0, 7));
  decoded.insert(decoded.end(), part.begin(), part.end());
  for (size_t t = 7; t < ids.size(); ++t) {
    part = m.forward(seq, ids.subspan(t, 1));
    decoded.insert(decoded.end(), part.begin(), part.end());
  }
  EXPECT_LT(compare(ref, decoded, V), kTolerance);
  // Irregular chunks crossing the CSA (4), HCA (16) and sliding-window (64) boundaries.
  std::vector<float> chunked;
  Sequence seq2 = m.new_sequence();
  size_t pos = 0;
  for (size_t n : {5, 13, 1, 30, 19, 28}) {
    part = m.forward(seq2, ids.subspan(pos, n));
    chunked.insert(chunked.end(), part.begin(), part.end());
    pos += n;
  }
  ASSERT_EQ(pos, ids.size());
  EXPECT_LT(compare(ref, chunked, V), kTolerance);
}

}  // namespace
}  // namespace keel
