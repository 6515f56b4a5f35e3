// The reference fixtures (tools/make_fixtures.py, from transformers 5.17) load and
// bind: official and transformers naming, fp32 and FP8 + MXFP4. Their logits are
// checked by the forward-pass tests.
#include <gtest/gtest.h>

#include <string>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/weights.h"

namespace keel {
namespace {

std::string fixture(const std::string& name) { return std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/" + name; }

struct Case {
  const char* dir;
  Naming naming;
  WeightFormat experts;
  bool mtp;
};

class Fixture : public ::testing::TestWithParam<Case> {};

TEST_P(Fixture, BindsEveryTensor) {
  const Case& c = GetParam();
  const auto dir = fixture(c.dir);
  const ModelConfig config = load_config(dir);
  const Checkpoint ckpt = Checkpoint::open(dir);
  EXPECT_FALSE(ckpt.contains("logits_full"));  // the index keeps reference.safetensors out
  const ModelWeights w = ModelWeights::bind(ckpt, config);
  EXPECT_EQ(w.naming(), c.naming);
  EXPECT_EQ(config.expert_format, c.experts);
  EXPECT_EQ(w.has_mtp(), c.mtp);
  EXPECT_TRUE(w.unused().empty()) << w.unused().front();
}

INSTANTIATE_TEST_SUITE_P(
    All, Fixture,
    ::testing::Values(Case{"tiny", Naming::official, WeightFormat::f32, false},
                      Case{"flashlike_sigmoid", Naming::official, WeightFormat::f32, true},
                      Case{"flashlike_sigmoid/transformers", Naming::transformers, WeightFormat::bf16, false},
                      Case{"tiny_quant", Naming::official, WeightFormat::mxfp4, true}),
    [](const auto& info) {
      std::string n = info.param.dir;
      for (char& ch : n)
        if (ch == '/') ch = '_';
      return n;
    });

TEST(Fixture, ReferenceHoldsLogits) {
  const auto ref = SafetensorsFile::open(fixture("tiny") + "/reference.safetensors");
  const TensorEntry* ids = ref.find("input_ids");
  const TensorEntry* logits = ref.find("logits_full");
  ASSERT_TRUE(ids && logits);
  EXPECT_EQ(ids->shape, (Shape{2, 45}));
  EXPECT_EQ(logits->shape, (Shape{2, 45, 97}));
  EXPECT_EQ(logits->dtype, DType::f32);
}

}  // namespace
}  // namespace keel
