#include "model/layers.h"

#include <string>

#include "base/dtype.h"
#include "base/error.h"

namespace keel {

std::vector<float> to_floats(const Weight& w) {
  const int64_t n = w.data.numel();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (w.data.dtype) {
      case DType::f32: out[i] = w.data.as<float>()[i]; break;
      case DType::bf16: out[i] = bf16_to_f32(w.data.as<uint16_t>()[i]); break;
      case DType::f16: out[i] = f16_to_f32(w.data.as<uint16_t>()[i]); break;
      default: fail(ErrorCode::unknown_dtype, {.tensor = w.spec->name}, "expected a float parameter");
    }
  }
  return out;
}

namespace {

std::vector<int32_t> to_ints(const Weight& w) {
  const int64_t n = w.data.numel();
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (w.data.dtype) {
      case DType::i64: out[i] = static_cast<int32_t>(w.data.as<int64_t>()[i]); break;
      case DType::i32: out[i] = w.data.as<int32_t>()[i]; break;
      default: fail(ErrorCode::unknown_dtype, {.tensor = w.spec->name}, "expected an integer table");
    }
  }
  return out;
}

// Looks tensors up under one name prefix.
struct Scope {
  const ModelWeights& w;
  std::string prefix;
  const Weight* linear(const std::string& name) const { return &w.at(prefix + name + ".weight"); }
  std::vector<float> norm(const std::string& name) const { return to_floats(w.at(prefix + name + ".weight")); }
  std::vector<float> param(const std::string& name) const { return to_floats(w.at(prefix + name)); }
  Scope sub(const std::string& name) const { return {w, prefix + name}; }
};

HyperSite hyper_site(const Scope& s, const std::string& site) {
  return {s.param(site + "_fn"), s.param(site + "_base"), s.param(site + "_scale")};
}

HyperHead hyper_head(const Scope& s) {
  return {s.param("hc_head_fn"), s.param("hc_head_base"), s.param("hc_head_scale")};
}

CompressorWeights compressor(const Scope& s, int ratio, int dim, bool overlapping) {
  return {s.linear("wkv"), s.linear("wgate"), s.param("ape"), s.norm("norm"), ratio, dim, overlapping};
}

AttentionWeights attention(const Scope& s, const ModelConfig& c, AttentionKind kind) {
  AttentionWeights a{kind,          s.linear("wq_a"),   s.linear("wq_b"),   s.linear("wkv"),
                     s.linear("wo_a"), s.linear("wo_b"), s.norm("q_norm"), s.norm("kv_norm"),
                     s.param("attn_sink")};
  if (kind == AttentionKind::heavily_compressed) {
    a.compressor = compressor(s.sub("compressor."), c.compress_ratio_hca, c.head_dim, false);
  } else if (kind == AttentionKind::compressed_sparse) {
    a.compressor = compressor(s.sub("compressor."), c.compress_ratio_csa, c.head_dim, true);
    const Scope i = s.sub("indexer.");
    a.indexer = IndexerWeights{compressor(i.sub("compressor."), c.compress_ratio_csa, c.index_head_dim, true),
                               i.linear("wq_b"), i.linear("weights_proj")};
  }
  return a;
}

ExpertWeights expert(const Scope& s) { return {s.linear("w1"), s.linear("w2"), s.linear("w3")}; }

MoeWeights moe(const Scope& s, const ModelConfig& c, MlpKind kind) {
  MoeWeights m{kind, s.linear("gate")};
  if (kind == MlpKind::hash_moe) {
    m.tid2eid = to_ints(s.w.at(s.prefix + "gate.tid2eid"));
    for (int32_t e : m.tid2eid) {
      if (e < 0 || e >= c.n_routed_experts) {
        fail(ErrorCode::weights_mismatch, {.tensor = s.prefix + "gate.tid2eid"},
             "expert id " + std::to_string(e) + " outside [0, " + std::to_string(c.n_routed_experts) + ")");
      }
    }
  } else {
    m.bias = s.param("gate.bias");
  }
  for (int e = 0; e < c.n_routed_experts; ++e) m.experts.push_back(expert(s.sub("experts." + std::to_string(e) + ".")));
  m.shared = expert(s.sub("shared_experts."));
  return m;
}

LayerWeights layer(const ModelWeights& w, const ModelConfig& c, int index) {
  const Scope s{w, layer_prefix(c, index)};
  return {hyper_site(s, "hc_attn"),
          hyper_site(s, "hc_ffn"),
          s.norm("attn_norm"),
          s.norm("ffn_norm"),
          attention(s.sub("attn."), c, c.attention[index]),
          moe(s.sub("ffn."), c, c.mlp[index])};
}

}  // namespace

ModelTensors gather_tensors(const ModelWeights& w, const ModelConfig& c) {
  const Scope top{w, ""};
  ModelTensors t{top.linear("embed"), top.linear("head"), top.norm("norm"), hyper_head(top)};
  for (int l = 0; l < c.num_hidden_layers; ++l) t.layers.push_back(layer(w, c, l));
  if (w.has_mtp()) {
    for (int d = 0; d < c.num_nextn_predict_layers; ++d) {
      const int index = c.num_hidden_layers + d;
      const Scope s{w, layer_prefix(c, index)};
      t.mtp.push_back({layer(w, c, index), s.linear("e_proj"), s.linear("h_proj"), s.norm("enorm"),
                       s.norm("hnorm"), s.norm("norm"), hyper_head(s)});
    }
  }
  return t;
}

}  // namespace keel
