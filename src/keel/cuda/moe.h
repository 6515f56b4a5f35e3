// The elementwise steps of the routed experts on the GPU (dsv4-forward.md §6.2): the
// clamped SwiGLU between the gate/up and down projections, as ops/moe.h's
// clamped_swiglu, and the weighted sum of each token's routed-expert outputs, as
// model/forward.cpp's moe. f32 in device memory, asynchronous
// on `stream` (0: the default stream). No registry entry: no Op names these steps, and
// the expert GEMMs around them are Op::moe_gemm.
#pragma once

#include <cstdint>

namespace keel::cuda {

// gate[i] ← silu(min(gate[i], limit)) · clamp(up[i], −limit, limit), for count floats.
void clamped_swiglu(float* gate, const float* up, int64_t count, float limit, void* stream = nullptr);

// out[t, :] = Σ_{i<k} weights[t·k + i] · y[t·k + i, :] (+ shared[t, :] when shared is
// not null) for t < tokens: y holds one row per (token, routed expert) pair, as
// cuda::linear_pairs writes them; out may not alias y.
void combine_pairs(const float* y, const float* weights, int64_t tokens, int k, int64_t dim, const float* shared,
                   float* out, void* stream = nullptr);

}  // namespace keel::cuda
