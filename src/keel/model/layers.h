// A layer's weights as the forward pass uses them: linears stay views of the checkpoint
// in their stored format (ops/linear.h decodes them row by row); the small parameters
// (norms, sinks, position biases, mHC, router bias, tid2eid) are copied to f32/i32.
#pragma once

#include <optional>
#include <vector>

#include "model/weights.h"
#include "ops/hyper.h"

namespace keel {

// Pools `ratio` tokens into one entry of `dim`; CSA's overlapping compressors project
// two series per token (width 2·dim).
struct CompressorWeights {
  const Weight* wkv = nullptr;    // [width, D]
  const Weight* wgate = nullptr;  // [width, D]
  std::vector<float> ape;         // [ratio, width] position bias of the gate logits
  std::vector<float> norm;        // [dim]
  int ratio = 0;
  int dim = 0;
  bool overlapping = false;
  int width() const { return overlapping ? 2 * dim : dim; }
};

struct IndexerWeights {
  CompressorWeights compressor;         // index keys, width dI
  const Weight* wq_b = nullptr;         // [nI·dI, q_lora_rank]
  const Weight* weights_proj = nullptr; // [nI, D]
};

struct AttentionWeights {
  AttentionKind kind = AttentionKind::sliding;
  const Weight *wq_a = nullptr, *wq_b = nullptr, *wkv = nullptr, *wo_a = nullptr, *wo_b = nullptr;
  std::vector<float> q_norm, kv_norm, sinks;
  std::optional<CompressorWeights> compressor;  // CSA and HCA
  std::optional<IndexerWeights> indexer;        // CSA
};

struct ExpertWeights {
  const Weight *w1 = nullptr, *w2 = nullptr, *w3 = nullptr;  // gate [I, D], down [D, I], up [I, D]
};

struct MoeWeights {
  MlpKind kind = MlpKind::moe;
  const Weight* gate = nullptr;    // router [E, D]
  std::vector<float> bias;         // [E] learned layers: selection-only correction
  std::vector<int32_t> tid2eid;    // [vocab, k] hash layers
  std::vector<ExpertWeights> experts;
  ExpertWeights shared;
};

struct LayerWeights {
  HyperSite hc_attn, hc_ffn;
  std::vector<float> attn_norm, ffn_norm;
  AttentionWeights attn;
  MoeWeights ffn;
};

// The MTP block's extra weights (dsv4-forward.md §8); loaded, run by speculative decoding.
struct MtpWeights {
  LayerWeights block;
  const Weight *e_proj = nullptr, *h_proj = nullptr;
  std::vector<float> enorm, hnorm, norm;
  HyperHead hc_head;
};

struct ModelTensors {
  const Weight* embed = nullptr;  // [V, D]
  const Weight* head = nullptr;   // [V, D]
  std::vector<float> norm;
  HyperHead hc_head;
  std::vector<LayerWeights> layers;
  std::vector<MtpWeights> mtp;    // empty when the checkpoint has none
};

ModelTensors gather_tensors(const ModelWeights& weights, const ModelConfig& config);

// A float parameter of any stored float dtype, as f32.
std::vector<float> to_floats(const Weight& w);

}  // namespace keel
