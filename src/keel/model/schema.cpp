#include "model/schema.h"

namespace keel {
namespace {

// Appends specs for one model, keeping the layer and the format rules in one place.
class SpecList {
 public:
  explicit SpecList(const ModelConfig& c) : c_(c) {}

  void linear(std::string name, int64_t out, int64_t in, WeightFormat format) {
    add(std::move(name) + ".weight", {out, in}, TensorRole::linear, format);
  }
  // Linears DeepSeek-V4 quantizes (attention projections, shared experts, MTP input
  // projections) follow the dense format; the rest stay bf16 (router, compressors,
  // indexer weights_proj) unless the whole checkpoint is f32.
  void dense(std::string name, int64_t out, int64_t in) { linear(std::move(name), out, in, c_.dense_format); }
  void plain(std::string name, int64_t out, int64_t in) { linear(std::move(name), out, in, plain_format()); }
  void norm(std::string name, int64_t dim) {
    add(std::move(name) + ".weight", {dim}, TensorRole::norm, plain_format());
  }
  void parameter(std::string name, Shape shape) {
    add(std::move(name), std::move(shape), TensorRole::parameter, WeightFormat::f32);
  }
  void table(std::string name, Shape shape) {
    add(std::move(name), std::move(shape), TensorRole::table, WeightFormat::f32);
  }

  void set_layer(int layer) { layer_ = layer; }
  std::vector<TensorSpec> take() { return std::move(specs_); }

 private:
  WeightFormat plain_format() const {
    return c_.dense_format == WeightFormat::f32 ? WeightFormat::f32 : WeightFormat::bf16;
  }
  void add(std::string name, Shape shape, TensorRole role, WeightFormat format) {
    specs_.push_back({std::move(name), std::move(shape), role, format, layer_});
  }

  const ModelConfig& c_;
  std::vector<TensorSpec> specs_;
  int layer_ = -1;
};

void add_hyper_connection(SpecList& s, const ModelConfig& c, const std::string& prefix) {
  const int64_t hc = c.hc_mult, mix = (2 + hc) * hc;
  s.parameter(prefix + "_fn", {mix, hc * c.hidden_size});
  s.parameter(prefix + "_base", {mix});
  s.parameter(prefix + "_scale", {3});
}

void add_hc_head(SpecList& s, const ModelConfig& c, const std::string& prefix) {
  const int64_t hc = c.hc_mult;
  s.parameter(prefix + "hc_head_fn", {hc, hc * c.hidden_size});
  s.parameter(prefix + "hc_head_base", {hc});
  s.parameter(prefix + "hc_head_scale", {1});
}

// A compressor pooling `ratio` tokens into entries of `dim`; CSA windows overlap, so
// each token projects two series (2 * dim).
void add_compressor(SpecList& s, const ModelConfig& c, const std::string& prefix, int ratio, int64_t dim,
                    bool overlapping) {
  const int64_t width = overlapping ? 2 * dim : dim;
  s.parameter(prefix + "ape", {ratio, width});
  s.plain(prefix + "wkv", width, c.hidden_size);
  s.plain(prefix + "wgate", width, c.hidden_size);
  s.norm(prefix + "norm", dim);
}

void add_attention(SpecList& s, const ModelConfig& c, const std::string& p, AttentionKind kind) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  s.parameter(p + "attn_sink", {H});
  s.dense(p + "wq_a", c.q_lora_rank, D);
  s.norm(p + "q_norm", c.q_lora_rank);
  s.dense(p + "wq_b", H * hd, c.q_lora_rank);
  s.dense(p + "wkv", hd, D);
  s.norm(p + "kv_norm", hd);
  s.dense(p + "wo_a", c.o_groups * c.o_lora_rank, H * hd / c.o_groups);
  s.dense(p + "wo_b", D, c.o_groups * c.o_lora_rank);
  if (kind == AttentionKind::compressed_sparse) {
    add_compressor(s, c, p + "compressor.", c.compress_ratio_csa, hd, true);
    add_compressor(s, c, p + "indexer.compressor.", c.compress_ratio_csa, c.index_head_dim, true);
    s.dense(p + "indexer.wq_b", int64_t{c.index_n_heads} * c.index_head_dim, c.q_lora_rank);
    s.plain(p + "indexer.weights_proj", c.index_n_heads, D);
  } else if (kind == AttentionKind::heavily_compressed) {
    add_compressor(s, c, p + "compressor.", c.compress_ratio_hca, hd, false);
  }
}

void add_moe(SpecList& s, const ModelConfig& c, const std::string& p, MlpKind kind) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  s.plain(p + "gate", c.n_routed_experts, D);
  if (kind == MlpKind::hash_moe) {
    s.table(p + "gate.tid2eid", {c.vocab_size, c.num_experts_per_tok});
  } else {
    s.parameter(p + "gate.bias", {c.n_routed_experts});
  }
  for (int e = 0; e < c.n_routed_experts; ++e) {
    const std::string ep = p + "experts." + std::to_string(e) + ".";
    s.linear(ep + "w1", I, D, c.expert_format);
    s.linear(ep + "w2", D, I, c.expert_format);
    s.linear(ep + "w3", I, D, c.expert_format);
  }
  s.dense(p + "shared_experts.w1", I, D);
  s.dense(p + "shared_experts.w2", D, I);
  s.dense(p + "shared_experts.w3", I, D);
}

void add_block(SpecList& s, const ModelConfig& c, int layer) {
  const std::string p = layer_prefix(c, layer);
  add_hyper_connection(s, c, p + "hc_attn");
  add_hyper_connection(s, c, p + "hc_ffn");
  s.norm(p + "attn_norm", c.hidden_size);
  s.norm(p + "ffn_norm", c.hidden_size);
  add_attention(s, c, p + "attn.", c.attention[layer]);
  add_moe(s, c, p + "ffn.", c.mlp[layer]);
}

}  // namespace

const char* name(TensorRole role) {
  switch (role) {
    case TensorRole::linear: return "linear";
    case TensorRole::norm: return "norm";
    case TensorRole::parameter: return "parameter";
    case TensorRole::table: return "table";
  }
  return "?";
}

std::string layer_prefix(const ModelConfig& config, int layer) {
  if (layer < config.num_hidden_layers) return "layers." + std::to_string(layer) + ".";
  return "mtp." + std::to_string(layer - config.num_hidden_layers) + ".";
}

std::vector<TensorSpec> expected_tensors(const ModelConfig& c) {
  SpecList s(c);
  s.plain("embed", c.vocab_size, c.hidden_size);
  s.plain("head", c.vocab_size, c.hidden_size);
  s.norm("norm", c.hidden_size);
  add_hc_head(s, c, "");
  for (int layer = 0; layer < c.num_layers_with_mtp(); ++layer) {
    s.set_layer(layer);
    add_block(s, c, layer);
    if (layer >= c.num_hidden_layers) {  // MTP: input projections, norms and its own hc_head
      const std::string p = layer_prefix(c, layer);
      s.dense(p + "e_proj", c.hidden_size, c.hidden_size);
      s.dense(p + "h_proj", c.hidden_size, c.hidden_size);
      s.norm(p + "enorm", c.hidden_size);
      s.norm(p + "hnorm", c.hidden_size);
      s.norm(p + "norm", c.hidden_size);
      add_hc_head(s, c, p);
    }
  }
  return s.take();
}

Shape stored_shape(const TensorSpec& spec) {
  const bool fp4 = spec.format == WeightFormat::mxfp4 || spec.format == WeightFormat::nvfp4;
  if (spec.role != TensorRole::linear || !fp4) return spec.shape;
  return {spec.shape[0], spec.shape[1] / 2};
}

Shape scale_shape(const TensorSpec& spec, const ModelConfig& config) {
  const int64_t out = spec.shape[0], in = spec.shape[1];
  switch (spec.format) {
    case WeightFormat::fp8_block:
      return {(out + config.fp8_block_rows - 1) / config.fp8_block_rows,
              (in + config.fp8_block_cols - 1) / config.fp8_block_cols};
    case WeightFormat::mxfp4: return {out, in / 32};
    case WeightFormat::nvfp4: return {out, in / 16};
    default: return {};
  }
}

}  // namespace keel
