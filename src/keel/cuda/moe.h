// The elementwise steps of the routed experts on the GPU (dsv4-forward.md §6.2): the
// clamped SwiGLU between the gate/up and down projections, as ops/moe.h's
// clamped_swiglu, and the weighted sum of each token's routed-expert outputs, as
// model/forward.cpp's moe. f32 in device memory, asynchronous
// on `stream` (0: the default stream). No registry entry: no Op names these steps, and
// the expert GEMMs around them are Op::moe_gemm.
#pragma once

#include <cstdint>
#include <span>

namespace keel::cuda {

// gate[i] ← silu(min(gate[i], limit)) · clamp(up[i], −limit, limit), for count floats.
void clamped_swiglu(float* gate, const float* up, int64_t count, float limit, void* stream = nullptr);

// The same over independent pieces (a layer's routed pairs and its shared expert), in
// one launch: each piece's floats as clamped_swiglu gives them alone.
struct SwigluPiece {
  float* gate;
  const float* up;
  int64_t count;
};
constexpr int kMaxSwigluPieces = 2;
void clamped_swiglu(std::span<const SwigluPiece> pieces, float limit, void* stream = nullptr);

// out[t, :] = Σ_{i<k} weights[t·k + i] · y[t·k + i, :] (+ shared[t, :] when shared is
// not null) for t < tokens: y holds one row per (token, routed expert) pair, as
// cuda::linear_pairs writes them; out may not alias y.
void combine_pairs(const float* y, const float* weights, int64_t tokens, int k, int64_t dim, const float* shared,
                   float* out, void* stream = nullptr);

// The (token, routed expert) pairs grouped by expert, so a grouped GEMM reads each
// expert's weights once for all its pairs: `order` gets the pair indices, expert by
// expert (negative ids last, as expert -1); `groups` gets one PairGroup per run of at
// most `tile` pairs of one expert in `order`, and `group_count` how many there are (at
// most pairs). The order within an expert is not fixed (atomics): a grouped GEMM must
// compute each pair's row independently of the pairs beside it. Device memory,
// asynchronous on `stream`; `experts` ids are below n_experts (or negative).
struct PairGroup {
  int32_t expert;  // -1: pairs routed nowhere (their rows are zeros)
  int32_t first;   // into order
  int32_t count;   // 1..tile
};
void group_pairs(const int32_t* experts, int64_t pairs, int n_experts, int tile, int32_t* order, PairGroup* groups,
                 int32_t* group_count, void* stream = nullptr);
// The most experts group_pairs takes (its counts live in one block's shared memory).
constexpr int kMaxGroupedExperts = 4096;

}  // namespace keel::cuda
