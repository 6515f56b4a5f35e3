// config.json -> one typed, validated DeepSeek-V4 model config.
//
// Both key sets are accepted (dsv4-forward.md §1, dsv4-checkpoint.md §1.1):
//   official:      compress_ratios (num_hidden_layers + num_nextn_predict_layers entries,
//                  the trailing ones for the MTP layers), num_hash_layers,
//                  qk_rope_head_dim, rope_scaling, compress_rope_theta, expert_dtype,
//                  quantization_config
//   transformers:  layer_types, mlp_layer_types, compress_rates, partial_rotary_factor,
//                  rope_parameters {"main": {...}, "compress": {...}}
// Every field is derived once here; nothing downstream reads JSON. Wrong JSON types,
// missing required keys and inconsistent values are errors naming the field; a DSpark
// drafter (dspark_* keys) is refused as unsupported_model. Where both key sets state the
// same fact (compress_ratios and layer_types, qk_rope_head_dim and partial_rotary_factor,
// ...), they must agree. JSON null counts as absent; unknown keys are ignored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

enum class AttentionKind : uint8_t {
  sliding,            // compress ratio 0: sliding window only
  compressed_sparse,  // CSA: overlapping compressor (ratio m_csa) + lightning indexer top-k
  heavily_compressed, // HCA: non-overlapping compressor (ratio m_hca)
};
enum class MlpKind : uint8_t { hash_moe, moe };
enum class ScoringFunc : uint8_t { sqrtsoftplus, sigmoid };

// How a group of weights is stored in the checkpoint.
enum class WeightFormat : uint8_t {
  bf16,
  f32,
  fp8_block,  // e4m3 with one scale per 128x128 block (ue8m0 or f32 scales)
  mxfp4,      // e2m1 pairs in I8, one ue8m0 scale per 32 inputs
  nvfp4,      // e2m1 pairs in U8, one e4m3 scale per 16 inputs, one f32 global scale
};
const char* name(AttentionKind kind);
const char* name(MlpKind kind);
const char* name(WeightFormat format);
const char* name(ScoringFunc func);

struct RopeConfig {
  double theta = 10000.0;
  int rope_dim = 64;  // rotated trailing channels (qk_rope_head_dim)
  bool yarn = false;
  double yarn_factor = 1.0;
  int64_t yarn_original_max_position = 0;
  double yarn_beta_fast = 32.0;
  double yarn_beta_slow = 1.0;

  bool operator==(const RopeConfig&) const = default;
};

struct ModelConfig {
  std::string source;  // the file it came from, for messages

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;          // D
  int num_hidden_layers = 0;        // trunk layers (MTP not counted)
  int num_attention_heads = 0;      // H
  int head_dim = 0;                 // hd
  int rope_dim = 0;                 // rd = qk_rope_head_dim
  int64_t q_lora_rank = 0;
  int o_groups = 0;                 // G
  int64_t o_lora_rank = 0;          // r
  int sliding_window = 0;
  int compress_ratio_csa = 4;       // m_csa
  int compress_ratio_hca = 128;     // m_hca
  int index_n_heads = 0;            // nI
  int index_head_dim = 0;           // dI
  int index_topk = 0;
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  double hc_eps = 1e-6;
  int n_routed_experts = 0;         // E
  int n_shared_experts = 1;
  int num_experts_per_tok = 0;      // k
  int64_t moe_intermediate_size = 0;  // I
  ScoringFunc scoring_func = ScoringFunc::sqrtsoftplus;
  double routed_scaling_factor = 1.0;
  double swiglu_limit = 0.0;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  int num_nextn_predict_layers = 0;  // MTP layers

  RopeConfig rope_main;      // sliding layers
  RopeConfig rope_compress;  // CSA / HCA layers (YaRN)

  // Derived schedules, one entry per trunk layer, then one per MTP layer.
  std::vector<AttentionKind> attention;  // size num_hidden_layers + num_nextn_predict_layers
  std::vector<MlpKind> mlp;              // likewise; MTP layers are always `moe`

  // Storage formats.
  WeightFormat dense_format = WeightFormat::bf16;   // attention / shared-expert linears
  WeightFormat expert_format = WeightFormat::bf16;  // routed experts
  bool fp8_scales_ue8m0 = false;                    // scale_fmt "ue8m0" (else f32 scales)
  int fp8_block_rows = 128, fp8_block_cols = 128;

  int num_layers_with_mtp() const { return num_hidden_layers + num_nextn_predict_layers; }
  int compress_ratio(int layer) const;  // 0, m_csa or m_hca
  int nope_dim() const { return head_dim - rope_dim; }

  bool operator==(const ModelConfig&) const = default;
};

ModelConfig parse_config(const std::string& json_text, const std::string& source);
ModelConfig load_config(const std::string& directory);  // reads DIRECTORY/config.json

// The official config.json of `config` (what `keel synth` writes).
std::string to_official_json(const ModelConfig& config);

// Human-readable summary, a few lines.
std::string describe(const ModelConfig& config);

}  // namespace keel
