// Mixture-of-experts routing on the GPU (dsv4-forward.md §6): the CUDA counterpart of
// ops/moe.h's score_router and route, tested against them.
#pragma once

#include <cstdint>

#include "io/config.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// Per token t (f32 / int32 in device memory): logits[t] ([tokens, experts]) are scored in
// place (sqrtsoftplus or sigmoid); the k experts are the top-k of score + bias (ties: the
// lower expert first; bias may be null), or hashed[t] ([tokens, k]) when hashed is not
// null; weights[t, i] = score[e_i] / (Σ_i score[e_i] + 1e-20) · scaling. experts_out and
// weights_out are [tokens, k]; k ≤ experts. Asynchronous on `stream`.
void route(float* logits, int64_t tokens, int experts, ScoringFunc func, const float* bias, const int32_t* hashed,
           int k, float scaling, int32_t* experts_out, float* weights_out, void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_moe_routing(Registry& registry);

}  // namespace keel::cuda
