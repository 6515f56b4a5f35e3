// config.json -> ModelConfig. Expected values come from dsv4-checkpoint.md §1.1 (the
// official Flash config.json) and dsv4-forward.md §1 and §10, never from the parser.
#include "io/config.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ostream>
#include <string>
#include <vector>

#include "base/error.h"
#include "testing.h"

namespace keel {
// So that a failed EXPECT_EQ on two configs prints every field.
void PrintTo(const ModelConfig& c, std::ostream* os) { *os << "\n" << to_official_json(c); }
}  // namespace keel

namespace keel {
namespace {

using json = nlohmann::json;
using AK = AttentionKind;

// DeepSeek-V4-Flash config.json with the official keys, as dsv4-checkpoint.md §1.1 lists
// them. compress_ratios: layers 0-1 sliding, even 2..42 CSA (4), odd 3..41 HCA (128),
// then the MTP layer (0): 44 entries.
const char* const kFlashOfficial = R"({
  "architectures": ["DeepseekV4ForCausalLM"],
  "model_type": "deepseek_v4",
  "vocab_size": 129280,
  "hidden_size": 4096,
  "num_hidden_layers": 43,
  "num_attention_heads": 64,
  "num_key_value_heads": 1,
  "head_dim": 512,
  "qk_rope_head_dim": 64,
  "q_lora_rank": 1024,
  "o_groups": 8,
  "o_lora_rank": 1024,
  "moe_intermediate_size": 2048,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "num_experts_per_tok": 6,
  "scoring_func": "sqrtsoftplus",
  "topk_method": "noaux_tc",
  "norm_topk_prob": true,
  "routed_scaling_factor": 1.5,
  "num_hash_layers": 3,
  "swiglu_limit": 10.0,
  "hc_mult": 4,
  "hc_sinkhorn_iters": 20,
  "hc_eps": 1e-6,
  "sliding_window": 128,
  "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                      4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                      4, 128, 4, 0],
  "index_n_heads": 64,
  "index_head_dim": 128,
  "index_topk": 512,
  "rope_theta": 10000,
  "compress_rope_theta": 160000,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "max_position_embeddings": 1048576,
  "rms_norm_eps": 1e-6,
  "num_nextn_predict_layers": 1,
  "tie_word_embeddings": false,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "torch_dtype": "bfloat16",
  "expert_dtype": "fp4",
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
})";

json flash() { return json::parse(kFlashOfficial); }

ModelConfig parse(const json& j, const std::string& source = "config.json") {
  return parse_config(j.dump(), source);
}

// The same model in transformers' keys (dsv4-forward.md §1.2): layer_types,
// mlp_layer_types, compress_rates, partial_rotary_factor 64/512, nested rope_parameters.
json flash_transformers() {
  json j = flash();
  for (const char* legacy : {"compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling",
                             "compress_rope_theta"})
    j.erase(legacy);
  json layer_types = json::array(), mlp_types = json::array();
  for (int i = 0; i < 43; ++i) {
    layer_types.push_back(i < 2 ? "sliding_attention"
                                : i % 2 == 0 ? "compressed_sparse_attention" : "heavily_compressed_attention");
    mlp_types.push_back(i < 3 ? "hash_moe" : "moe");
  }
  j["layer_types"] = layer_types;
  j["mlp_layer_types"] = mlp_types;
  j["compress_rates"] = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}};
  j["partial_rotary_factor"] = 0.125;
  j["rope_parameters"] = {
      {"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.125}}},
      {"compress", {{"rope_type", "yarn"}, {"factor", 16.0}, {"original_max_position_embeddings", 65536},
                    {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"attention_factor", 1.0},
                    {"rope_theta", 160000.0}, {"partial_rotary_factor", 0.125}}},
  };
  return j;
}

// The tiny configuration of dsv4-forward.md §10, in transformers' keys, fp32.
json tiny_transformers() {
  return json::parse(R"({
    "model_type": "deepseek_v4", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 5,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
    "q_lora_rank": 24, "o_groups": 2, "o_lora_rank": 12, "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "swiglu_limit": 0.7,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32.0, "beta_slow": 1.0},
    "max_position_embeddings": 256, "torch_dtype": "float32", "pad_token_id": null,
    "rope_scaling": null, "unknown_future_key": {"anything": [1, "x"]}
  })");
}

// DeepSeek-V4-Flash-Base: experts FP8 128x128 with f32 scales (dsv4-checkpoint.md §2.3).
json flash_base() {
  json j = flash();
  j["expert_dtype"] = "fp8";
  j["quantization_config"].erase("scale_fmt");
  return j;
}

json bf16_plain() {
  json j = flash();
  j.erase("quantization_config");
  j.erase("expert_dtype");
  return j;
}

// NVIDIA's NVFP4 re-quant: FP8 dense, NVFP4 experts.
json flash_nvfp4() {
  json j = flash();
  j["quantization_config"]["moe_quant_algo"] = "NVFP4";
  return j;
}

int count(const std::vector<AK>& kinds, AK kind, size_t begin, size_t end) {
  int n = 0;
  for (size_t i = begin; i < end; ++i) n += kinds[i] == kind;
  return n;
}

TEST(Config, FlashOfficialShape) {
  const ModelConfig c = parse(flash());
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_hidden_layers, 43);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.num_layers_with_mtp(), 44);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.nope_dim(), 448);
  EXPECT_EQ(c.q_lora_rank, 1024);
  EXPECT_EQ(c.o_groups, 8);
  EXPECT_EQ(c.o_lora_rank, 1024);
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_EQ(c.compress_ratio_csa, 4);
  EXPECT_EQ(c.compress_ratio_hca, 128);
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 512);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.hc_eps, 1e-6);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.scoring_func, ScoringFunc::sqrtsoftplus);
  EXPECT_EQ(c.routed_scaling_factor, 1.5);
  EXPECT_EQ(c.swiglu_limit, 10.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_EQ(c.source, "config.json");
}

TEST(Config, FlashSchedule) {
  const ModelConfig c = parse(flash());
  ASSERT_EQ(c.attention.size(), 44u);
  ASSERT_EQ(c.mlp.size(), 44u);
  EXPECT_EQ(c.attention[0], AK::sliding);
  EXPECT_EQ(c.attention[1], AK::sliding);
  for (int i = 2; i <= 42; i += 2) EXPECT_EQ(c.attention[i], AK::compressed_sparse) << i;
  for (int i = 3; i <= 41; i += 2) EXPECT_EQ(c.attention[i], AK::heavily_compressed) << i;
  EXPECT_EQ(count(c.attention, AK::compressed_sparse, 0, 43), 21);
  EXPECT_EQ(count(c.attention, AK::heavily_compressed, 0, 43), 20);
  EXPECT_EQ(c.attention[43], AK::sliding);  // the MTP layer
  for (int i = 0; i < 44; ++i) EXPECT_EQ(c.mlp[i], i < 3 ? MlpKind::hash_moe : MlpKind::moe) << i;
  EXPECT_EQ(c.compress_ratio(0), 0);
  EXPECT_EQ(c.compress_ratio(2), 4);
  EXPECT_EQ(c.compress_ratio(3), 128);
  EXPECT_EQ(c.compress_ratio(43), 0);
  KEEL_EXPECT_ERROR(c.compress_ratio(44), ErrorCode::usage);
}

TEST(Config, FlashRopes) {
  const ModelConfig c = parse(flash());
  EXPECT_EQ(c.rope_main.theta, 10000.0);
  EXPECT_EQ(c.rope_main.rope_dim, 64);
  EXPECT_FALSE(c.rope_main.yarn);
  EXPECT_EQ(c.rope_compress.theta, 160000.0);
  EXPECT_EQ(c.rope_compress.rope_dim, 64);
  EXPECT_TRUE(c.rope_compress.yarn);
  EXPECT_EQ(c.rope_compress.yarn_factor, 16.0);
  EXPECT_EQ(c.rope_compress.yarn_original_max_position, 65536);
  EXPECT_EQ(c.rope_compress.yarn_beta_fast, 32.0);
  EXPECT_EQ(c.rope_compress.yarn_beta_slow, 1.0);
}

TEST(Config, FlashFormats) {
  const ModelConfig c = parse(flash());
  EXPECT_EQ(c.dense_format, WeightFormat::fp8_block);
  EXPECT_EQ(c.expert_format, WeightFormat::mxfp4);
  EXPECT_TRUE(c.fp8_scales_ue8m0);
  EXPECT_EQ(c.fp8_block_rows, 128);
  EXPECT_EQ(c.fp8_block_cols, 128);
}

TEST(Config, TransformersKeysGiveTheSameFlash) {
  EXPECT_EQ(parse(flash_transformers()), parse(flash()));
}

TEST(Config, BothKeySetsTogetherAgree) {
  json j = flash_transformers();
  j.update(flash());  // official keys beside the transformers ones
  EXPECT_EQ(parse(j), parse(flash()));
}

TEST(Config, TinyTransformers) {
  const ModelConfig c = parse(tiny_transformers());
  EXPECT_EQ(c.vocab_size, 97);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.rope_dim, 8);  // int(32 * 0.25)
  EXPECT_EQ(c.q_lora_rank, 24);
  EXPECT_EQ(c.o_groups, 2);
  EXPECT_EQ(c.o_lora_rank, 12);
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.compress_ratio_csa, 4);
  EXPECT_EQ(c.compress_ratio_hca, 8);
  EXPECT_EQ(c.index_n_heads, 16);
  EXPECT_EQ(c.index_head_dim, 16);
  EXPECT_EQ(c.index_topk, 3);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.n_routed_experts, 6);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.swiglu_limit, 0.7);
  EXPECT_EQ(c.max_position_embeddings, 256);
  // Not given: the transformers defaults (= Flash values).
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.routed_scaling_factor, 1.5);
  EXPECT_EQ(c.rope_main.theta, 10000.0);
  EXPECT_EQ(c.rope_compress.theta, 160000.0);
  const std::vector<AK> attention = {AK::sliding, AK::compressed_sparse, AK::heavily_compressed,
                                     AK::compressed_sparse, AK::heavily_compressed, AK::sliding};
  EXPECT_EQ(c.attention, attention);
  const std::vector<MlpKind> mlp = {MlpKind::hash_moe, MlpKind::hash_moe, MlpKind::moe,
                                    MlpKind::moe, MlpKind::moe, MlpKind::moe};
  EXPECT_EQ(c.mlp, mlp);
  EXPECT_EQ(c.compress_ratio(2), 8);
  EXPECT_TRUE(c.rope_compress.yarn);
  EXPECT_EQ(c.rope_compress.yarn_factor, 4.0);
  EXPECT_EQ(c.rope_compress.yarn_original_max_position, 16);
  EXPECT_EQ(c.rope_compress.yarn_beta_fast, 32.0);
  EXPECT_EQ(c.rope_compress.yarn_beta_slow, 1.0);
  EXPECT_FALSE(c.rope_main.yarn);
  EXPECT_EQ(c.dense_format, WeightFormat::f32);
  EXPECT_EQ(c.expert_format, WeightFormat::f32);
}

TEST(Config, FlashBaseHasFp8ExpertsWithF32Scales) {
  const ModelConfig c = parse(flash_base());
  EXPECT_EQ(c.dense_format, WeightFormat::fp8_block);
  EXPECT_EQ(c.expert_format, WeightFormat::fp8_block);
  EXPECT_FALSE(c.fp8_scales_ue8m0);
}

TEST(Config, Bf16WithoutQuantization) {
  const ModelConfig c = parse(bf16_plain());
  EXPECT_EQ(c.dense_format, WeightFormat::bf16);
  EXPECT_EQ(c.expert_format, WeightFormat::bf16);
}

TEST(Config, Nvfp4Experts) {
  EXPECT_EQ(parse(flash_nvfp4()).expert_format, WeightFormat::nvfp4);
  EXPECT_EQ(parse(flash_nvfp4()).dense_format, WeightFormat::fp8_block);
  json modelopt = flash();
  modelopt["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}};
  EXPECT_EQ(parse(modelopt).expert_format, WeightFormat::nvfp4);
  modelopt["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "MIXED_PRECISION"},
                                     {"moe_quant_algo", "NVFP4"}};
  EXPECT_EQ(parse(modelopt).expert_format, WeightFormat::nvfp4);
}

TEST(Config, RoundTripThroughOfficialJson) {
  for (const json& j : {flash(), flash_transformers(), tiny_transformers(), flash_base(), bf16_plain(),
                        flash_nvfp4()}) {
    const ModelConfig c = parse(j, "round trip");
    const ModelConfig back = parse_config(to_official_json(c), "round trip");
    EXPECT_EQ(back, c);
  }
}

TEST(Config, OfficialJsonHasTheOfficialKeys) {
  const json j = json::parse(to_official_json(parse(tiny_transformers())));
  EXPECT_EQ(j["architectures"], json::array({"DeepseekV4ForCausalLM"}));
  EXPECT_EQ(j["model_type"], "deepseek_v4");
  EXPECT_EQ(j["compress_ratios"], json::parse("[0, 4, 8, 4, 8, 0]"));
  EXPECT_EQ(j["num_hash_layers"], 2);
  EXPECT_EQ(j["qk_rope_head_dim"], 8);
  EXPECT_EQ(j["rope_scaling"]["type"], "yarn");
  EXPECT_EQ(j["compress_rope_theta"], 160000.0);
  EXPECT_FALSE(j.contains("layer_types"));
  EXPECT_FALSE(j.contains("quantization_config"));
  const json f = json::parse(to_official_json(parse(flash())));
  EXPECT_EQ(f["expert_dtype"], "fp4");
  EXPECT_EQ(f["quantization_config"]["scale_fmt"], "ue8m0");
  EXPECT_EQ(f["compress_ratios"].size(), 44u);
}

TEST(Config, TrailingRatioFourMakesTheMtpLayerCsa) {
  json j = flash();
  j["compress_ratios"][43] = 4;
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.attention[43], AK::compressed_sparse);
  EXPECT_EQ(c.mlp[43], MlpKind::moe);
  EXPECT_EQ(c.compress_ratio(43), 4);
}

TEST(Config, TrunkOnlyRatiosMakeTheMtpLayersSliding) {
  json j = flash();
  j["compress_ratios"].erase(43);
  j["num_nextn_predict_layers"] = 2;
  const ModelConfig c = parse(j);
  ASSERT_EQ(c.attention.size(), 45u);
  EXPECT_EQ(c.attention[43], AK::sliding);
  EXPECT_EQ(c.attention[44], AK::sliding);
}

TEST(Config, DescribeShowsTheSchedule) {
  const std::string text = describe(parse(flash()));
  EXPECT_NE(text.find("attention: S S C H C H"), std::string::npos) << text;
  EXPECT_NE(text.find("C H C | mtp: S"), std::string::npos) << text;
  EXPECT_NE(text.find("experts mxfp4"), std::string::npos) << text;
  EXPECT_NE(text.find("ue8m0"), std::string::npos) << text;
}

TEST(Config, NamesOfKinds) {
  EXPECT_STREQ(name(AK::compressed_sparse), "compressed_sparse");
  EXPECT_STREQ(name(MlpKind::hash_moe), "hash_moe");
  EXPECT_STREQ(name(WeightFormat::mxfp4), "mxfp4");
  EXPECT_STREQ(name(ScoringFunc::sigmoid), "sigmoid");
}

TEST(Config, LoadReadsConfigJsonFromTheDirectory) {
  testing::TempDir dir("config");
  testing::write_file(dir.file("config.json"), std::string(kFlashOfficial));
  const ModelConfig c = load_config(dir.path().string());
  EXPECT_EQ(c.source, dir.file("config.json"));
  EXPECT_EQ(c.num_hidden_layers, 43);
}

TEST(Config, LoadNamesTheMissingFile) {
  testing::TempDir dir("config-missing");
  const std::string message = KEEL_EXPECT_ERROR(load_config(dir.path().string()), ErrorCode::io);
  EXPECT_NE(message.find(dir.file("config.json")), std::string::npos) << message;
}

TEST(Config, IndexKeysAreOptionalWithoutCsaLayers) {
  json j = flash();
  for (auto& r : j["compress_ratios"])
    if (r == 4) r = 128;
  for (const char* key : {"index_n_heads", "index_head_dim", "index_topk"}) j.erase(key);
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.index_topk, 0);
  EXPECT_EQ(parse_config(to_official_json(c), c.source), c);
}

// ---- errors: each names the file and the field ----

// Parses `j` expecting `code`; checks that the error names `field` and returns the message.
std::string expect_error(const json& j, ErrorCode code, const std::string& field) {
  try {
    parse(j, "cfg.json");
  } catch (const Error& e) {
    EXPECT_EQ(name(e.code()), name(code)) << e.what();
    EXPECT_EQ(e.context().file, "cfg.json");
    EXPECT_EQ(e.context().field, field) << e.what();
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected " << name(code) << " on " << field;
  return {};
}

json with(json j, const json::json_pointer& at, const json& value) {
  j[at] = value;
  return j;
}

json without(json j, const std::string& key) {
  j.erase(key);
  return j;
}

TEST(ConfigError, MalformedJson) {
  for (const char* text : {"{", "", "{\"hidden_size\": 1,}", "[1, 2]", "\"text\"", "null"})
    KEEL_EXPECT_ERROR(parse_config(text, "cfg.json"), ErrorCode::config_json);
  const std::string message = KEEL_EXPECT_ERROR(parse_config("[]", "cfg.json"), ErrorCode::config_json);
  EXPECT_NE(message.find("cfg.json"), std::string::npos);
}

TEST(ConfigError, MissingKey) {
  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                          "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
                          "moe_intermediate_size", "hc_mult", "sliding_window", "index_n_heads",
                          "index_head_dim", "index_topk"})
    expect_error(without(flash(), key), ErrorCode::config_missing, key);
  expect_error(with(flash(), "/hidden_size"_json_pointer, nullptr), ErrorCode::config_missing, "hidden_size");
  expect_error(without(flash(), "compress_ratios"), ErrorCode::config_missing, "compress_ratios");
  json no_factor = flash();
  no_factor["rope_scaling"].erase("factor");
  expect_error(no_factor, ErrorCode::config_missing, "rope_scaling.factor");
  json no_method = flash();
  no_method["quantization_config"].erase("quant_method");
  expect_error(no_method, ErrorCode::config_missing, "quantization_config.quant_method");
}

TEST(ConfigError, WrongType) {
  std::string message = expect_error(with(flash(), "/hidden_size"_json_pointer, "4096"), ErrorCode::config_type,
                                     "hidden_size");
  EXPECT_NE(message.find("expected integer, found string"), std::string::npos) << message;
  message = expect_error(with(flash(), "/hidden_size"_json_pointer, 4096.0), ErrorCode::config_type, "hidden_size");
  EXPECT_NE(message.find("found float"), std::string::npos) << message;
  message = expect_error(with(flash(), "/compress_ratios"_json_pointer, json::array({"0", "4"})),
                         ErrorCode::config_type, "compress_ratios");
  EXPECT_NE(message.find("entry 0: expected integer, found string"), std::string::npos) << message;
  expect_error(with(flash(), "/rope_scaling/factor"_json_pointer, "16"), ErrorCode::config_type,
               "rope_scaling.factor");
  expect_error(with(flash(), "/rope_scaling"_json_pointer, "yarn"), ErrorCode::config_type, "rope_scaling");
  expect_error(with(flash(), "/tie_word_embeddings"_json_pointer, 0), ErrorCode::config_type, "tie_word_embeddings");
  expect_error(with(flash(), "/compress_ratios"_json_pointer, 4), ErrorCode::config_type, "compress_ratios");
  expect_error(with(flash(), "/quantization_config/weight_block_size"_json_pointer, json::array({128.5, 128})),
               ErrorCode::config_type, "quantization_config.weight_block_size");
  expect_error(with(flash_transformers(), "/rope_parameters/compress"_json_pointer, 1), ErrorCode::config_type,
               "rope_parameters.compress");
  expect_error(with(flash(), "/rms_norm_eps"_json_pointer, "1e-6"), ErrorCode::config_type, "rms_norm_eps");
}

TEST(ConfigError, OutOfRange) {
  for (const char* key : {"vocab_size", "hidden_size", "head_dim", "q_lora_rank", "o_lora_rank",
                          "sliding_window", "moe_intermediate_size", "num_experts_per_tok"})
    expect_error(with(flash(), json::json_pointer(std::string("/").append(key)), 0), ErrorCode::config_value, key);
  expect_error(with(flash(), "/hidden_size"_json_pointer, -4096), ErrorCode::config_value, "hidden_size");
  expect_error(with(flash(), "/hidden_size"_json_pointer, 1ull << 40), ErrorCode::config_value, "hidden_size");
  expect_error(json::parse(R"({"vocab_size": 18446744073709551615})"), ErrorCode::config_value, "vocab_size");
  expect_error(with(flash(), "/hc_mult"_json_pointer, 0), ErrorCode::config_value, "hc_mult");
  expect_error(with(flash(), "/index_topk"_json_pointer, 0), ErrorCode::config_value, "index_topk");
  expect_error(with(flash(), "/rms_norm_eps"_json_pointer, 0.0), ErrorCode::config_value, "rms_norm_eps");
  expect_error(with(flash(), "/rope_theta"_json_pointer, 1), ErrorCode::config_value, "rope_theta");
  expect_error(with(flash(), "/rope_scaling/factor"_json_pointer, 0.5), ErrorCode::config_value,
               "rope_scaling.factor");
  // A number beyond double range is refused while parsing.
  std::string text = flash().dump();
  text.replace(text.find("\"rope_theta\":10000"), 18, "\"rope_theta\":1e999");
  KEEL_EXPECT_ERROR(parse_config(text, "cfg.json"), ErrorCode::config_json);
}

TEST(ConfigError, InconsistentValues) {
  std::string message = expect_error(with(flash(), "/num_key_value_heads"_json_pointer, 2), ErrorCode::config_value,
                                     "num_key_value_heads");
  EXPECT_NE(message.find("K=V"), std::string::npos) << message;
  expect_error(with(flash(), "/num_experts_per_tok"_json_pointer, 257), ErrorCode::config_value,
               "num_experts_per_tok");
  expect_error(with(flash(), "/o_groups"_json_pointer, 7), ErrorCode::config_value, "o_groups");
  expect_error(with(flash(), "/qk_rope_head_dim"_json_pointer, 1024), ErrorCode::config_value, "qk_rope_head_dim");
  expect_error(with(flash(), "/qk_rope_head_dim"_json_pointer, 63), ErrorCode::config_value, "qk_rope_head_dim");
  expect_error(with(flash_transformers(), "/partial_rotary_factor"_json_pointer, 1.5), ErrorCode::config_value,
               "partial_rotary_factor");
  expect_error(with(flash(), "/index_head_dim"_json_pointer, 32), ErrorCode::config_value, "index_head_dim");
  expect_error(with(flash(), "/eos_token_id"_json_pointer, 129280), ErrorCode::config_value, "eos_token_id");
  expect_error(with(flash(), "/n_shared_experts"_json_pointer, 2), ErrorCode::config_value, "n_shared_experts");
  expect_error(with(flash(), "/num_nextn_predict_layers"_json_pointer, 44), ErrorCode::config_value,
               "num_nextn_predict_layers");
  expect_error(with(flash(), "/hidden_size"_json_pointer, 4112), ErrorCode::config_value, "hidden_size");
  expect_error(with(flash(), "/compress_rate_hca"_json_pointer, 4), ErrorCode::config_value, "compress_rate_hca");
  expect_error(with(flash(), "/rope_scaling/attention_factor"_json_pointer, 1.277), ErrorCode::config_value,
               "rope_scaling.attention_factor");
}

TEST(ConfigError, ScheduleLengthAndRatios) {
  json j = flash();
  j["compress_ratios"].push_back(0);
  std::string message = expect_error(j, ErrorCode::config_value, "compress_ratios");
  EXPECT_NE(message.find("45 entries"), std::string::npos) << message;
  message = expect_error(with(flash(), "/compress_ratios/5"_json_pointer, 7), ErrorCode::config_value,
                         "compress_ratios");
  EXPECT_NE(message.find("layer 5"), std::string::npos) << message;
  message = expect_error(with(flash(), "/compress_ratios/43"_json_pointer, 64), ErrorCode::config_value,
                         "compress_ratios");
  EXPECT_NE(message.find("layer 43 (MTP 0)"), std::string::npos) << message;
  message = expect_error(with(flash_transformers(), "/layer_types/4"_json_pointer, "full_attention"),
                         ErrorCode::config_value, "layer_types");
  EXPECT_NE(message.find("layer 4"), std::string::npos) << message;
  expect_error(with(flash_transformers(), "/mlp_layer_types/9"_json_pointer, "dense"), ErrorCode::config_value,
               "mlp_layer_types");
  expect_error(with(flash_transformers(), "/mlp_layer_types/9"_json_pointer, "hash_moe"), ErrorCode::config_value,
               "mlp_layer_types");
}

TEST(ConfigError, KeySetsThatDisagree) {
  json j = flash();
  j["layer_types"] = flash_transformers()["layer_types"];
  j["layer_types"][7] = "compressed_sparse_attention";
  std::string message = expect_error(j, ErrorCode::config_value, "layer_types");
  EXPECT_NE(message.find("layer 7"), std::string::npos) << message;
  expect_error(with(flash(), "/partial_rotary_factor"_json_pointer, 0.25), ErrorCode::config_value,
               "partial_rotary_factor");
  json mlp = flash();
  mlp["mlp_layer_types"] = flash_transformers()["mlp_layer_types"];
  mlp["mlp_layer_types"][2] = "moe";  // two hash layers, num_hash_layers says three
  expect_error(mlp, ErrorCode::config_value, "mlp_layer_types");
  json rope = flash_transformers();
  rope["rope_scaling"] = flash()["rope_scaling"];
  rope["rope_scaling"]["factor"] = 8;
  expect_error(rope, ErrorCode::config_value, "rope_parameters.compress");
}

TEST(ConfigError, UnknownStrings) {
  std::string message = expect_error(with(flash(), "/scoring_func"_json_pointer, "softmax"), ErrorCode::config_value,
                                     "scoring_func");
  EXPECT_NE(message.find("softmax is not supported"), std::string::npos) << message;
  EXPECT_EQ(parse(with(flash(), "/scoring_func"_json_pointer, "sigmoid")).scoring_func, ScoringFunc::sigmoid);
  expect_error(with(flash(), "/expert_dtype"_json_pointer, "int4"), ErrorCode::config_value, "expert_dtype");
  expect_error(with(flash(), "/torch_dtype"_json_pointer, "float16"), ErrorCode::config_value, "torch_dtype");
  expect_error(with(flash(), "/quantization_config/quant_method"_json_pointer, "awq"), ErrorCode::config_value,
               "quantization_config.quant_method");
  expect_error(with(flash(), "/quantization_config/fmt"_json_pointer, "e5m2"), ErrorCode::config_value,
               "quantization_config.fmt");
  expect_error(with(flash(), "/quantization_config/scale_fmt"_json_pointer, "e4m3"), ErrorCode::config_value,
               "quantization_config.scale_fmt");
  expect_error(with(flash(), "/rope_scaling/type"_json_pointer, "longrope"), ErrorCode::config_value,
               "rope_scaling.type");
  expect_error(with(flash_nvfp4(), "/expert_dtype"_json_pointer, "fp8"), ErrorCode::config_value, "expert_dtype");
}

TEST(ConfigError, DSparkDrafterIsRefused) {
  // DeepSeek-V4-Flash-0731 (dsv4-checkpoint.md §1.1, §3.6).
  json j = flash();
  j["dspark_block_size"] = 5;
  j["dspark_target_layer_ids"] = {40, 41, 42};
  j["compress_ratios"].push_back(0);
  j["compress_ratios"].push_back(0);
  std::string message = expect_error(j, ErrorCode::unsupported_model, "dspark_block_size");
  EXPECT_NE(message.find("DSpark"), std::string::npos) << message;
  EXPECT_NE(message.find("0731"), std::string::npos) << message;
  EXPECT_NE(message.find("not the 1-layer MTP"), std::string::npos) << message;
}

TEST(ConfigError, OtherModelTypeIsRefused) {
  expect_error(with(flash(), "/model_type"_json_pointer, "deepseek_v3"), ErrorCode::unsupported_model,
               "model_type");
}

}  // namespace
}  // namespace keel
