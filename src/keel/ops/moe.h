// Mixture-of-experts routing and the clamped SwiGLU (dsv4-forward.md §6).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "io/config.h"

namespace keel {

struct Routing {
  std::vector<int32_t> experts;  // [k]
  std::vector<float> weights;    // [k]
};

// Scores the router logits in place (sqrtsoftplus or sigmoid).
void score_router(std::span<float> logits, ScoringFunc func);

// Learned routing: top-k of score + bias (ties: lower expert first); `hashed` (non-empty)
// replaces the selection (hash layers: tid2eid[token]). Weights are the unbiased scores
// of the selection, normalized (+1e-20) and times `scaling`.
Routing route(std::span<const float> scores, std::span<const float> bias, std::span<const int32_t> hashed, int k,
              float scaling);

// h = silu(min(gate, limit)) · clamp(up, −limit, limit), in place into `gate`.
void clamped_swiglu(std::span<float> gate, std::span<const float> up, float limit);

}  // namespace keel
