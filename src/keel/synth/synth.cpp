#include "synth/synth.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numbers>

#include "base/dtype.h"
#include "base/error.h"
#include "io/safetensors.h"
#include "model/schema.h"
#include "quant/fp8_block.h"

namespace keel {
namespace {

using nlohmann::json;

// Presets in official config.json keys; `compress_ratios` is filled in per layer count.
const std::map<std::string, json>& presets() {
  static const std::map<std::string, json> table = {
      {"tiny", {{"vocab_size", 1024}, {"hidden_size", 64}, {"num_hidden_layers", 5},
                {"num_attention_heads", 4}, {"head_dim", 32}, {"qk_rope_head_dim", 8},
                {"q_lora_rank", 24}, {"o_groups", 2}, {"o_lora_rank", 12},
                {"moe_intermediate_size", 32}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2},
                {"num_hash_layers", 2}, {"swiglu_limit", 0.7}, {"sliding_window", 8},
                {"compress_rate_csa", 4}, {"compress_rate_hca", 8},
                {"index_n_heads", 16}, {"index_head_dim", 16}, {"index_topk", 3},
                {"rope_scaling", {{"type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 16},
                                  {"beta_fast", 32}, {"beta_slow", 1}}},
                {"max_position_embeddings", 4096}}},
      {"small", {{"vocab_size", 32768}, {"hidden_size", 1024}, {"num_hidden_layers", 6},
                 {"num_attention_heads", 16}, {"head_dim", 128}, {"qk_rope_head_dim", 64},
                 {"q_lora_rank", 512}, {"o_groups", 4}, {"o_lora_rank", 256},
                 {"moe_intermediate_size", 512}, {"n_routed_experts", 32}, {"num_experts_per_tok", 4},
                 {"num_hash_layers", 2}, {"swiglu_limit", 10.0}, {"sliding_window", 128},
                 {"compress_rate_csa", 4}, {"compress_rate_hca", 128},
                 {"index_n_heads", 16}, {"index_head_dim", 64}, {"index_topk", 64},
                 {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 4096},
                                   {"beta_fast", 32}, {"beta_slow", 1}}},
                 {"max_position_embeddings", 65536}}},
      {"flash", {{"vocab_size", 129280}, {"hidden_size", 4096}, {"num_hidden_layers", 43},
                 {"num_attention_heads", 64}, {"head_dim", 512}, {"qk_rope_head_dim", 64},
                 {"q_lora_rank", 1024}, {"o_groups", 8}, {"o_lora_rank", 1024},
                 {"moe_intermediate_size", 2048}, {"n_routed_experts", 256}, {"num_experts_per_tok", 6},
                 {"num_hash_layers", 3}, {"swiglu_limit", 10.0}, {"sliding_window", 128},
                 {"compress_rate_csa", 4}, {"compress_rate_hca", 128},
                 {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 512},
                 {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536},
                                   {"beta_fast", 32}, {"beta_slow", 1}}},
                 {"max_position_embeddings", 1048576}}},
  };
  return table;
}

// What every preset shares with DeepSeek-V4-Flash.
json common_keys() {
  return {{"architectures", {"DeepseekV4ForCausalLM"}}, {"model_type", "deepseek_v4"},
          {"num_key_value_heads", 1}, {"n_shared_experts", 1}, {"scoring_func", "sqrtsoftplus"},
          {"topk_method", "noaux_tc"}, {"norm_topk_prob", true}, {"routed_scaling_factor", 1.5},
          {"hc_mult", 4}, {"hc_sinkhorn_iters", 20}, {"hc_eps", 1e-6}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0}, {"compress_rope_theta", 160000.0}, {"tie_word_embeddings", false},
          {"bos_token_id", 0}, {"eos_token_id", 1}, {"expert_dtype", "fp4"},
          {"quantization_config", {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                                   {"scale_fmt", "ue8m0"}, {"weight_block_size", {128, 128}}}}};
}

// Flash's schedule: two sliding layers, then CSA on even and HCA on odd layers; the
// MTP layers are sliding.
json compress_ratios(int layers, int mtp_layers, int csa, int hca) {
  json ratios = json::array();
  for (int i = 0; i < layers; ++i) ratios.push_back(i < 2 ? 0 : (i % 2 == 0 ? csa : hca));
  for (int i = 0; i < mtp_layers; ++i) ratios.push_back(0);
  return ratios;
}

// xoshiro256** seeded by splitmix64: fast, and each tensor gets its own stream from
// the seed and its name, so a tensor's values do not depend on what came before.
class Rng {
 public:
  Rng(uint64_t seed, const std::string& name) {
    uint64_t x = seed ^ std::hash<std::string>{}(name) * 0x9e3779b97f4a7c15ull;
    for (auto& s : s_) s = splitmix(x);
  }
  uint64_t next() {
    const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return result;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t below(uint64_t n) { return next() % n; }
  // Box-Muller, both values of each pair used; never exactly zero, so no parameter is
  // accidentally neutral.
  float normal() {
    for (;;) {
      float z;
      if (has_spare_) {
        z = spare_;
        has_spare_ = false;
      } else {
        const double r = std::sqrt(-2.0 * std::log(1.0 - uniform())), t = 2 * std::numbers::pi * uniform();
        z = static_cast<float>(r * std::cos(t));
        spare_ = static_cast<float>(r * std::sin(t));
        has_spare_ = true;
      }
      if (z != 0.0f) return z;
    }
  }

 private:
  static uint64_t splitmix(uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t s_[4];
  float spare_ = 0;
  bool has_spare_ = false;
};

// How each parameter is drawn (dsv4-forward.md §10): mean + std * N(0, 1), the std
// divided by sqrt(fan in) for matrices. Matched on the end of the official name.
struct Init {
  const char* suffix;
  float mean;
  float stddev;
};
constexpr Init kInits[] = {
    {"attn_sink", 0.0f, 1.0f},  {"ape", 0.0f, 0.5f},       {"_base", 0.0f, 0.5f},
    {"_scale", 1.0f, 0.3f},     {"gate.bias", 0.0f, 0.3f}, {"norm.weight", 1.0f, 0.2f},
};

Init init_for(const TensorSpec& spec) {
  for (const Init& i : kInits) {
    const std::string_view s = i.suffix;
    if (spec.name.size() >= s.size() && spec.name.compare(spec.name.size() - s.size(), s.size(), s) == 0) return i;
  }
  if (spec.name == "embed.weight") return {"", 0.0f, 1.0f};
  // Matrices (linears, hc_*_fn): unit variance after the product.
  return {"", 0.0f, 1.0f / std::sqrt(static_cast<float>(spec.shape.back()))};
}

std::vector<float> draw(const TensorSpec& spec, Rng& rng) {
  const Init init = init_for(spec);
  std::vector<float> v(static_cast<size_t>(numel(spec.shape)));
  for (auto& x : v) x = init.mean + init.stddev * rng.normal();
  return v;
}

void fill_float(const TensorSpec& spec, DType dtype, Rng& rng, std::span<std::byte> out) {
  const auto v = draw(spec, rng);
  if (dtype == DType::f32) {
    std::memcpy(out.data(), v.data(), out.size());
    return;
  }
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < v.size(); ++i) dst[i] = f32_to_bf16(v[i]);
}

// Rows of `k` distinct experts: a partial Fisher-Yates shuffle per token.
void fill_tid2eid(const TensorSpec& spec, int experts, Rng& rng, std::span<std::byte> out) {
  const int64_t rows = spec.shape[0], k = spec.shape[1];
  auto* dst = reinterpret_cast<int64_t*>(out.data());
  std::vector<int64_t> ids(experts);
  for (int64_t r = 0; r < rows; ++r) {
    for (int e = 0; e < experts; ++e) ids[e] = e;
    for (int64_t j = 0; j < k; ++j) {
      std::swap(ids[j], ids[j + rng.below(experts - j)]);
      dst[r * k + j] = ids[j];
    }
  }
}

// Random MXFP4 straight from codes: uniform e2m1 nibbles (RMS 2.93) under a per-block
// power-of-two scale near 1 / (2.93 sqrt(fan in)), two random exponents apart so the
// scales vary. Drawing floats and quantizing would be ~50x slower at Flash width.
void fill_mxfp4(const TensorSpec& spec, Rng& rng, std::span<std::byte> packed, std::span<std::byte> scales) {
  for (size_t i = 0; i < packed.size(); i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(&packed[i], &r, std::min<size_t>(8, packed.size() - i));
  }
  const int base = static_cast<int>(std::lround(std::log2(1.0 / (2.93 * std::sqrt(double(spec.shape[1]))))));
  for (auto& s : scales) s = static_cast<std::byte>(127 + base - static_cast<int>(rng.below(2)));
}

struct Planned {
  const TensorSpec* spec;
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t bytes;
};

DType float_dtype(WeightFormat f) { return f == WeightFormat::f32 ? DType::f32 : DType::bf16; }

// The stored tensors of one spec: the weight, and its scale sidecar if quantized.
std::vector<Planned> plan(const TensorSpec& spec, const ModelConfig& c) {
  auto sized = [](const TensorSpec* s, std::string name, DType d, Shape shape) {
    const uint64_t bytes = storage_bytes(d, static_cast<uint64_t>(numel(shape))).value();
    return Planned{s, std::move(name), d, std::move(shape), bytes};
  };
  const std::string scale_name = spec.name.substr(0, spec.name.size() - 6) + "scale";
  switch (spec.role == TensorRole::linear ? spec.format : WeightFormat::bf16) {
    case WeightFormat::fp8_block:
      return {sized(&spec, spec.name, DType::f8_e4m3, spec.shape),
              sized(&spec, scale_name, DType::f8_e8m0, scale_shape(spec, c))};
    case WeightFormat::mxfp4:
      return {sized(&spec, spec.name, DType::i8, stored_shape(spec)),
              sized(&spec, scale_name, DType::f8_e8m0, scale_shape(spec, c))};
    case WeightFormat::nvfp4:
      fail(ErrorCode::usage, {.tensor = spec.name}, "keel synth writes MXFP4 experts, not NVFP4");
    default:
      break;
  }
  const DType d = spec.role == TensorRole::table       ? DType::i64
                  : spec.role == TensorRole::parameter ? DType::f32
                                                       : float_dtype(spec.format);
  return {sized(&spec, spec.name, d, spec.shape)};
}

// Writes one shard; quantized weights are drawn once and split into weight and scale.
class ShardWriter {
 public:
  ShardWriter(const ModelConfig& c, uint64_t seed) : c_(c), seed_(seed) {}

  void add(SafetensorsWriter& w, const std::vector<Planned>& parts) {
    const TensorSpec& spec = *parts[0].spec;
    if (parts.size() == 1) {
      w.add(parts[0].name, parts[0].dtype, parts[0].shape, [this, &spec, d = parts[0].dtype](std::span<std::byte> out) {
        Rng rng(seed_, spec.name);
        if (spec.role == TensorRole::table) {
          fill_tid2eid(spec, c_.n_routed_experts, rng, out);
        } else {
          fill_float(spec, d, rng, out);
        }
      });
      return;
    }
    // Weight and scale come from the same draw: the weight's fill makes both and keeps
    // the scale bytes until the scale's fill (written right after it) asks for them.
    auto scale = std::make_shared<std::vector<std::byte>>();
    w.add(parts[0].name, parts[0].dtype, parts[0].shape,
          [this, &spec, scale, bytes = parts[1].bytes](std::span<std::byte> out) {
      scale->resize(bytes);
      Rng rng(seed_, spec.name);
      if (spec.format == WeightFormat::mxfp4) {
        fill_mxfp4(spec, rng, out, *scale);
        return;
      }
      const auto v = draw(spec, rng);
      const Fp8BlockShape shape{spec.shape[0], spec.shape[1], c_.fp8_block_rows, c_.fp8_block_cols};
      quantize_fp8_block(v, shape, ScaleFormat::ue8m0, {reinterpret_cast<uint8_t*>(out.data()), out.size()},
                         {reinterpret_cast<uint8_t*>(scale->data()), scale->size()});
    });
    w.add(parts[1].name, parts[1].dtype, parts[1].shape,
          [scale](std::span<std::byte> out) {
            std::memcpy(out.data(), scale->data(), out.size());
            std::vector<std::byte>().swap(*scale);
          });
  }

 private:
  const ModelConfig& c_;
  uint64_t seed_;
};

}  // namespace

std::vector<std::string> synth_shapes() {
  std::vector<std::string> names;
  for (const auto& [name, _] : presets()) names.push_back(name);
  return names;
}

ModelConfig synth_config(const SynthOptions& options) {
  const auto it = presets().find(options.shape);
  if (it == presets().end()) {
    std::string known;
    for (const auto& n : synth_shapes()) known += (known.empty() ? "" : ", ") + n;
    fail(ErrorCode::usage, {.field = "shape"}, "unknown shape '" + options.shape + "' (known: " + known + ")");
  }
  json j = common_keys();
  j.update(it->second);
  const int layers = options.layers > 0 ? options.layers : j["num_hidden_layers"].get<int>();
  const int mtp = options.mtp_layers >= 0 ? options.mtp_layers : 1;
  j["num_hidden_layers"] = layers;
  j["num_nextn_predict_layers"] = mtp;
  j["compress_ratios"] = compress_ratios(layers, mtp, j["compress_rate_csa"], j["compress_rate_hca"]);
  return parse_config(j.dump(2), "keel synth --shape " + options.shape);
}

SynthResult synth_checkpoint(const SynthOptions& options, const std::string& directory) {
  SynthResult result{synth_config(options), {}, 0, 0};
  const ModelConfig& c = result.config;
  std::filesystem::create_directories(directory);

  std::vector<std::vector<Planned>> shards(1);
  uint64_t shard_size = 0;
  const auto specs = expected_tensors(c);
  for (const TensorSpec& spec : specs) {
    auto parts = plan(spec, c);
    uint64_t bytes = 0;
    for (const auto& p : parts) bytes += p.bytes;
    if (shard_size > 0 && shard_size + bytes > options.shard_bytes) {
      shards.emplace_back();
      shard_size = 0;
    }
    shard_size += bytes;
    for (auto& p : parts) shards.back().push_back(std::move(p));
  }

  // Shards are independent files and every tensor draws from its own seeded stream, so
  // they are written in parallel with the same bytes as one at a time.
  ShardWriter writer(c, options.seed);
  const auto file_name = [&](size_t s) {
    return shards.size() == 1 ? std::string("model.safetensors")
                              : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
  };
  std::vector<uint64_t> tensors(shards.size()), bytes(shards.size());
  std::vector<std::exception_ptr> errors(shards.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t s = 0; s < shards.size(); ++s) {
    try {
      SafetensorsWriter w;
      w.set_metadata("format", "pt");
      for (size_t i = 0; i < shards[s].size();) {
        // A quantized weight and its scale are consecutive and share one draw.
        const bool pair = i + 1 < shards[s].size() && shards[s][i + 1].spec == shards[s][i].spec;
        std::vector<Planned> parts(shards[s].begin() + i, shards[s].begin() + i + (pair ? 2 : 1));
        writer.add(w, parts);
        i += parts.size();
      }
      w.write((std::filesystem::path(directory) / file_name(s)).string());
      tensors[s] = w.entries().size();
      bytes[s] = w.data_bytes();
    } catch (...) {
      errors[s] = std::current_exception();
    }
  }
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  std::map<std::string, std::string> weight_map;
  for (size_t s = 0; s < shards.size(); ++s) {
    for (const Planned& p : shards[s]) weight_map[p.name] = file_name(s);
    result.files.push_back(file_name(s));
    result.tensors += tensors[s];
    result.bytes += bytes[s];
  }
  if (shards.size() > 1) {
    write_safetensors_index(directory, weight_map, result.bytes);
    result.files.push_back("model.safetensors.index.json");
  }
  const auto config_path = (std::filesystem::path(directory) / "config.json").string();
  std::ofstream config_file(config_path);
  config_file << to_official_json(c) << "\n";
  if (!config_file.flush()) fail(ErrorCode::io, {.file = config_path}, "cannot write");
  result.files.push_back("config.json");
  return result;
}

}  // namespace keel
