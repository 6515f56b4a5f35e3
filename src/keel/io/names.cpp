#include "io/names.h"

#include <array>
#include <regex>
#include <span>
#include <string_view>
#include <utility>

#include "io/safetensors.h"

namespace keel {
namespace {

using Rename = std::pair<std::string_view, std::string_view>;

constexpr auto kTopLevel = std::to_array<Rename>({
    {"embed.weight", "model.embed_tokens.weight"},
    {"head.weight", "lm_head.weight"},
    {"norm.weight", "model.norm.weight"},
    {"hc_head_fn", "model.hc_head.hc_fn"},
    {"hc_head_base", "model.hc_head.hc_base"},
    {"hc_head_scale", "model.hc_head.hc_scale"},
});

// Names inside "layers.N." -> names inside "model.layers.N.".
constexpr auto kInLayer = std::to_array<Rename>({
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"hc_attn_fn", "attn_hc.fn"},
    {"hc_attn_base", "attn_hc.base"},
    {"hc_attn_scale", "attn_hc.scale"},
    {"hc_ffn_fn", "ffn_hc.fn"},
    {"hc_ffn_base", "ffn_hc.base"},
    {"hc_ffn_scale", "ffn_hc.scale"},
    {"attn.attn_sink", "self_attn.sinks"},
    {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attn.q_norm.weight", "self_attn.q_a_norm.weight"},
    {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attn.wkv.weight", "self_attn.kv_proj.weight"},
    {"attn.kv_norm.weight", "self_attn.kv_norm.weight"},
    {"attn.wo_a.weight", "self_attn.o_a_proj.weight"},
    {"attn.wo_b.weight", "self_attn.o_b_proj.weight"},
    {"attn.compressor.ape", "self_attn.compressor.position_bias"},
    {"attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
    {"attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
    {"attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
    {"attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
    {"attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"},
    {"attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"},
    {"attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"},
    {"attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"},
    {"attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"},
    {"ffn.gate.weight", "mlp.gate.weight"},
    {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
    {"ffn.gate.tid2eid", "mlp.gate.tid2eid"},
    {"ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
    {"ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
});

std::optional<std::string_view> lookup(std::string_view key, std::span<const Rename> table) {
  for (const auto& [from, to] : table)
    if (from == key) return to;
  return std::nullopt;
}

}  // namespace

const char* name(Naming naming) { return naming == Naming::official ? "official" : "transformers"; }

Naming detect_naming(const Checkpoint& checkpoint) {
  return checkpoint.contains("model.embed_tokens.weight") ? Naming::transformers : Naming::official;
}

std::optional<std::string> transformers_name(const std::string& official) {
  if (auto top = lookup(official, kTopLevel)) return std::string(*top);
  static const std::regex layer(R"(layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(official, m, layer)) return std::nullopt;
  auto inner = lookup(m[2].str(), kInLayer);
  if (!inner) return std::nullopt;
  return "model.layers." + m[1].str() + "." + std::string(*inner);
}

std::optional<ExpertName> parse_expert_name(const std::string& official) {
  static const std::regex expert(R"(layers\.(\d+)\.ffn\.experts\.(\d+)\.w([123])\.weight)");
  std::smatch m;
  if (!std::regex_match(official, m, expert)) return std::nullopt;
  return ExpertName{std::stoi(m[1].str()), std::stoi(m[2].str()), std::stoi(m[3].str())};
}

std::string transformers_gate_up(int layer) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts.gate_up_proj";
}
std::string transformers_down(int layer) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts.down_proj";
}

}  // namespace keel
