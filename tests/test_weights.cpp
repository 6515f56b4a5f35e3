// The tensor schema against the published DeepSeek-V4-Flash checkpoint layout, and
// binding checkpoints (official and transformers naming) against it.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "io/config.h"
#include "io/names.h"
#include "io/safetensors.h"
#include "model/schema.h"
#include "model/weights.h"
#include "synth/synth.h"
#include "testing.h"

namespace keel {
namespace {

std::map<std::string, TensorSpec> by_name(const std::vector<TensorSpec>& specs) {
  std::map<std::string, TensorSpec> m;
  for (const auto& s : specs) EXPECT_TRUE(m.emplace(s.name, s).second) << "duplicate " << s.name;
  return m;
}

class FlashSchema : public ::testing::Test {
 protected:
  void SetUp() override {
    config = synth_config({.shape = "flash"});
    specs = by_name(expected_tensors(config));
  }
  // Checks one row of dsv4-checkpoint.md §1.2: logical shape, format, scale shape.
  void expect(const std::string& name, Shape shape, WeightFormat format, Shape scale = {}) {
    SCOPED_TRACE(name);
    auto it = specs.find(name);
    ASSERT_NE(it, specs.end());
    EXPECT_EQ(it->second.shape, shape);
    EXPECT_EQ(it->second.format, format);
    EXPECT_EQ(scale_shape(it->second, config), scale);
  }
  ModelConfig config;
  std::map<std::string, TensorSpec> specs;
};

TEST_F(FlashSchema, TopLevelAndAttention) {
  expect("embed.weight", {129280, 4096}, WeightFormat::bf16);
  expect("head.weight", {129280, 4096}, WeightFormat::bf16);
  EXPECT_EQ(specs.at("norm.weight").shape, (Shape{4096}));
  EXPECT_EQ(specs.at("hc_head_fn").shape, (Shape{4, 16384}));
  EXPECT_EQ(specs.at("hc_head_scale").shape, (Shape{1}));
  EXPECT_EQ(specs.at("layers.0.hc_attn_fn").shape, (Shape{24, 16384}));
  EXPECT_EQ(specs.at("layers.0.hc_ffn_scale").shape, (Shape{3}));
  EXPECT_EQ(specs.at("layers.5.attn.attn_sink").shape, (Shape{64}));
  expect("layers.5.attn.wq_a.weight", {1024, 4096}, WeightFormat::fp8_block, {8, 32});
  expect("layers.5.attn.wq_b.weight", {32768, 1024}, WeightFormat::fp8_block, {256, 8});
  expect("layers.5.attn.wkv.weight", {512, 4096}, WeightFormat::fp8_block, {4, 32});
  expect("layers.5.attn.wo_a.weight", {8192, 4096}, WeightFormat::fp8_block, {64, 32});
  expect("layers.5.attn.wo_b.weight", {4096, 8192}, WeightFormat::fp8_block, {32, 64});
  EXPECT_EQ(specs.at("layers.5.attn.q_norm.weight").shape, (Shape{1024}));
  EXPECT_EQ(specs.at("layers.5.attn.kv_norm.weight").shape, (Shape{512}));
}

TEST_F(FlashSchema, CompressorsAndIndexer) {
  // Layer 2 is CSA (ratio 4), layer 3 HCA (ratio 128), layers 0-1 sliding only.
  EXPECT_EQ(specs.at("layers.2.attn.compressor.ape").shape, (Shape{4, 1024}));
  expect("layers.2.attn.compressor.wkv.weight", {1024, 4096}, WeightFormat::bf16);
  expect("layers.2.attn.compressor.wgate.weight", {1024, 4096}, WeightFormat::bf16);
  EXPECT_EQ(specs.at("layers.2.attn.compressor.norm.weight").shape, (Shape{512}));
  EXPECT_EQ(specs.at("layers.2.attn.indexer.compressor.ape").shape, (Shape{4, 256}));
  expect("layers.2.attn.indexer.compressor.wkv.weight", {256, 4096}, WeightFormat::bf16);
  EXPECT_EQ(specs.at("layers.2.attn.indexer.compressor.norm.weight").shape, (Shape{128}));
  expect("layers.2.attn.indexer.wq_b.weight", {8192, 1024}, WeightFormat::fp8_block, {64, 8});
  expect("layers.2.attn.indexer.weights_proj.weight", {64, 4096}, WeightFormat::bf16);
  EXPECT_EQ(specs.at("layers.3.attn.compressor.ape").shape, (Shape{128, 512}));
  expect("layers.3.attn.compressor.wkv.weight", {512, 4096}, WeightFormat::bf16);
  EXPECT_FALSE(specs.count("layers.3.attn.indexer.wq_b.weight"));
  EXPECT_FALSE(specs.count("layers.1.attn.compressor.ape"));
  EXPECT_FALSE(specs.count("mtp.0.attn.compressor.ape"));  // the MTP layer is sliding
}

TEST_F(FlashSchema, MoeAndMtp) {
  expect("layers.4.ffn.gate.weight", {256, 4096}, WeightFormat::bf16);
  EXPECT_EQ(specs.at("layers.2.ffn.gate.tid2eid").shape, (Shape{129280, 6}));  // hash layers 0..2
  EXPECT_FALSE(specs.count("layers.2.ffn.gate.bias"));
  EXPECT_EQ(specs.at("layers.3.ffn.gate.bias").shape, (Shape{256}));
  EXPECT_FALSE(specs.count("layers.3.ffn.gate.tid2eid"));
  expect("layers.7.ffn.experts.255.w1.weight", {2048, 4096}, WeightFormat::mxfp4, {2048, 128});
  expect("layers.7.ffn.experts.0.w2.weight", {4096, 2048}, WeightFormat::mxfp4, {4096, 64});
  EXPECT_EQ(stored_shape(specs.at("layers.7.ffn.experts.0.w3.weight")), (Shape{2048, 2048}));
  EXPECT_EQ(stored_shape(specs.at("layers.7.ffn.experts.0.w2.weight")), (Shape{4096, 1024}));
  expect("layers.7.ffn.shared_experts.w1.weight", {2048, 4096}, WeightFormat::fp8_block, {16, 32});
  expect("layers.7.ffn.shared_experts.w2.weight", {4096, 2048}, WeightFormat::fp8_block, {32, 16});
  expect("mtp.0.e_proj.weight", {4096, 4096}, WeightFormat::fp8_block, {32, 32});
  expect("mtp.0.h_proj.weight", {4096, 4096}, WeightFormat::fp8_block, {32, 32});
  EXPECT_EQ(specs.at("mtp.0.hc_head_fn").shape, (Shape{4, 16384}));
  EXPECT_EQ(specs.at("mtp.0.ffn.gate.bias").shape, (Shape{256}));
  EXPECT_FALSE(specs.count("mtp.0.ffn.gate.tid2eid"));
  EXPECT_FALSE(specs.count("mtp.0.embed.weight"));  // shared with the trunk
}

TEST_F(FlashSchema, DtypeCensusMatchesTheReleasedCheckpoint) {
  // The released DeepSeek-V4-Flash holds 69,187 tensors: BF16 433, F32 417,
  // F8_E4M3 375, F8_E8M0 34,167, I64 3, I8 33,792 (dsv4-checkpoint.md §1.2).
  std::map<std::string, int> census;
  for (const auto& [name, spec] : specs) {
    switch (spec.role == TensorRole::linear ? spec.format : WeightFormat::bf16) {
      case WeightFormat::fp8_block: census["F8_E4M3"]++, census["F8_E8M0"]++; continue;
      case WeightFormat::mxfp4: census["I8"]++, census["F8_E8M0"]++; continue;
      default: break;
    }
    if (spec.role == TensorRole::table) census["I64"]++;
    else if (spec.role == TensorRole::parameter) census["F32"]++;
    else census["BF16"]++;
  }
  EXPECT_EQ(census, (std::map<std::string, int>{{"BF16", 433}, {"F32", 417}, {"F8_E4M3", 375},
                                                 {"F8_E8M0", 34167}, {"I64", 3}, {"I8", 33792}}));
}

TEST(Weights, BindsASynthCheckpoint) {
  testing::TempDir dir("weights-synth");
  const auto r = synth_checkpoint({.shape = "tiny", .seed = 3}, dir.path().string());
  const auto ckpt = Checkpoint::open(dir.path().string());
  const auto w = ModelWeights::bind(ckpt, load_config(dir.path().string()));
  EXPECT_EQ(w.naming(), Naming::official);
  EXPECT_TRUE(w.has_mtp());
  EXPECT_TRUE(w.unused().empty());
  EXPECT_EQ(w.size(), w.specs().size());
  const Weight& wq = w.at("layers.2.attn.wq_a.weight");
  EXPECT_EQ(wq.format, WeightFormat::fp8_block);
  EXPECT_EQ(wq.data.dtype, DType::f8_e4m3);
  EXPECT_EQ(wq.scale.dtype, DType::f8_e8m0);
  const Weight& expert = w.at("mtp.0.ffn.experts.7.w2.weight");
  EXPECT_EQ(expert.format, WeightFormat::mxfp4);
  EXPECT_EQ(expert.data.shape, (Shape{64, 16}));  // [D, I/2]
  EXPECT_EQ(expert.scale.shape, (Shape{64, 1}));
  EXPECT_EQ(w.at("norm.weight").format, WeightFormat::bf16);
  EXPECT_EQ(w.at("layers.0.ffn.gate.tid2eid").data.dtype, DType::i64);
}

TEST(Weights, ShardedSynthCheckpoint) {
  testing::TempDir dir("weights-sharded");
  const auto r = synth_checkpoint({.shape = "tiny", .seed = 5, .shard_bytes = 256 << 10}, dir.path().string());
  const auto ckpt = Checkpoint::open(dir.path().string());
  EXPECT_GT(ckpt.files().size(), 2u);
  EXPECT_EQ(ckpt.names().size(), r.tensors);
  EXPECT_NO_THROW(ModelWeights::bind(ckpt, load_config(dir.path().string())));
}

TEST(Weights, ReportsEveryProblemAtOnce) {
  testing::TempDir good("weights-good"), bad("weights-bad");
  synth_checkpoint({.shape = "tiny", .seed = 4}, good.path().string());
  const auto src = Checkpoint::open(good.path().string());
  // Copy every tensor but: drop one scale, reshape the final norm, retype a sink.
  SafetensorsWriter w;
  for (const auto& name : src.names()) {
    if (name == "layers.1.attn.wkv.scale") continue;
    const TensorEntry* e = src.find(name);
    const auto bytes = src.view(name).bytes();
    std::vector<std::byte> copy(bytes.begin(), bytes.end());
    if (name == "norm.weight") {
      w.add_bytes(name, e->dtype, {e->shape[0] / 2, 2}, std::move(copy));
    } else if (name == "layers.0.attn.attn_sink") {
      w.add_bytes(name, DType::i32, e->shape, std::move(copy));
    } else {
      w.add_bytes(name, e->dtype, e->shape, std::move(copy));
    }
  }
  w.write(bad.file("model.safetensors"));
  std::filesystem::copy_file(good.file("config.json"), bad.file("config.json"));
  const auto ckpt = Checkpoint::open(bad.path().string());
  const auto config = load_config(bad.path().string());
  try {
    ModelWeights::bind(ckpt, config);
    FAIL() << "expected weights_mismatch";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::weights_mismatch);
    ASSERT_EQ(e.details().size(), 3u) << e.what();
    const std::string all = e.what();
    EXPECT_NE(all.find("missing fp8 block scale 'layers.1.attn.wkv.scale'"), std::string::npos) << all;
    EXPECT_NE(all.find("'norm.weight': shape [32, 2], expected [64]"), std::string::npos) << all;
    EXPECT_NE(all.find("'layers.0.attn.attn_sink': dtype I32, expected BF16|F32"), std::string::npos) << all;
    EXPECT_NE(all.find(bad.path().string()), std::string::npos) << all;
  }
}

// A bf16 variant of the tiny preset, as transformers would save it: its names, fused
// experts, and no MTP layer.
TEST(Weights, BindsTransformersNamingWithFusedExperts) {
  auto j = nlohmann::json::parse(to_official_json(synth_config({.shape = "tiny"})));
  j.erase("quantization_config");
  j.erase("expert_dtype");
  const ModelConfig c = parse_config(j.dump(), "bf16 tiny");
  ASSERT_EQ(c.dense_format, WeightFormat::bf16);
  ASSERT_EQ(c.expert_format, WeightFormat::bf16);

  testing::TempDir dir("weights-hf");
  SafetensorsWriter w;
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, D = c.hidden_size;
  // Fused expert values encode (expert, row, col) so a wrong slice is caught.
  auto fused = [](int64_t experts, int64_t rows, int64_t cols) {
    std::vector<std::byte> bytes(experts * rows * cols * 4);
    auto* f = reinterpret_cast<float*>(bytes.data());
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < cols; ++k) f[(e * rows + r) * cols + k] = float(e * 1e4 + r * 10 + k % 10);
    return bytes;
  };
  for (const auto& spec : expected_tensors(c)) {
    if (spec.layer >= c.num_hidden_layers || parse_expert_name(spec.name)) continue;
    const auto hf = transformers_name(spec.name);
    ASSERT_TRUE(hf) << spec.name;
    const DType d = spec.role == TensorRole::table ? DType::i64 : DType::f32;
    w.add_bytes(*hf, d, spec.shape, std::vector<std::byte>(numel(spec.shape) * bits(d) / 8, std::byte{1}));
  }
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    w.add_bytes(transformers_gate_up(layer), DType::f32, {E, 2 * I, D}, fused(E, 2 * I, D));
    w.add_bytes(transformers_down(layer), DType::f32, {E, D, I}, fused(E, D, I));
  }
  w.write(dir.file("model.safetensors"));
  const auto ckpt = Checkpoint::open(dir.path().string());
  const auto mw = ModelWeights::bind(ckpt, c);
  EXPECT_EQ(mw.naming(), Naming::transformers);
  EXPECT_FALSE(mw.has_mtp());
  EXPECT_TRUE(mw.unused().empty());
  // Expert 5's up projection (w3) is rows [I, 2I) of gate_up_proj[5].
  const Weight& up = mw.at("layers.3.ffn.experts.5.w3.weight");
  EXPECT_EQ(up.data.shape, (Shape{I, D}));
  EXPECT_EQ(up.data.as<float>()[0], float(5 * 1e4 + I * 10));
  EXPECT_EQ(up.data.as<float>()[1 * D + 3], float(5 * 1e4 + (I + 1) * 10 + 3));
  const Weight& down = mw.at("layers.3.ffn.experts.2.w2.weight");
  EXPECT_EQ(down.data.as<float>()[4 * I + 7], float(2 * 1e4 + 4 * 10 + 7));
  EXPECT_EQ(mw.at("layers.2.attn.indexer.weights_proj.weight").data.dtype, DType::f32);
}

}  // namespace
}  // namespace keel
