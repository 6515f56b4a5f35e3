// Checkpoint tensor naming. keel speaks the official DeepSeek-V4 names internally
// ("layers.3.attn.wq_a.weight"); checkpoints saved by transformers use its own names
// ("model.layers.3.self_attn.q_a_proj.weight") and fuse the routed experts of a layer
// into two tensors (dsv4-checkpoint.md §1.3, dsv4-forward.md §11).
#pragma once

#include <optional>
#include <string>

namespace keel {

class Checkpoint;

enum class Naming : uint8_t { official, transformers };
const char* name(Naming naming);

// transformers checkpoints are recognised by their embedding's name.
Naming detect_naming(const Checkpoint& checkpoint);

// The transformers name of an official one; nullopt for names transformers does not
// have: routed experts (fused, see below) and the MTP layer (never saved by it).
std::optional<std::string> transformers_name(const std::string& official);

// A routed expert weight "layers.N.ffn.experts.E.wK.weight", split into its parts.
struct ExpertName {
  int layer = 0;
  int expert = 0;
  int which = 0;  // 1 gate, 2 down, 3 up (official w1/w2/w3)
};
std::optional<ExpertName> parse_expert_name(const std::string& official);

// The fused transformers tensors: gate_up_proj [E, 2I, D] (gate rows first) and
// down_proj [E, D, I].
std::string transformers_gate_up(int layer);
std::string transformers_down(int layer);

}  // namespace keel
