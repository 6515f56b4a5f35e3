// Rotary position embedding on the GPU (dsv4-forward.md §2.3): the CUDA counterpart of
// ops/rope.h, tested against it. The trailing rope_dim channels of each head rotate in
// adjacent pairs (2i, 2i+1) by position · inv_freq[i]; the leading channels stay.
#pragma once

#include <cstdint>
#include <span>

#include "ops/rope.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// A Rope's frequencies in device memory (computed on the host by ops/rope.cpp).
struct DeviceRope {
  const float* inv_freq = nullptr;  // device, [rope_dim / 2]
  int rope_dim = 0;
};

DeviceRope upload(const Rope& rope);  // throws std::runtime_error on CUDA failure
void release(DeviceRope& rope);

// x is [tokens, heads, head_dim] f32 in device memory, rotated in place; positions is
// [tokens] in device memory. The angle is float(position) · inv_freq[i] in f32, as the
// CPU; its cos and sin come from sincosf (the CPU rounds double cos/sin of the same f32
// angle, so the two differ by at most a couple of ULPs of the factors). `inverse`
// rotates by the negated angle (the attention output). Asynchronous on `stream`.
void rope(const DeviceRope& rope, float* x, int64_t tokens, int heads, int head_dim, const int64_t* positions,
          bool inverse, void* stream = nullptr);

// Each of the tokens · heads rows of head_dim floats in x, in place: its RMSNorm with
// eps (by `weight` [head_dim] in device memory, or unweighted when null), then the
// forward rotation above at its token's position; as ops/norm.cpp, then ops/rope.cpp.
// An attention site's q heads and its kv rows each take one launch (rows of float4
// chunks up to 4096 floats; other rows take the norm's kernel and then rope's).
void norm_rope(const DeviceRope& rope, float* x, int64_t tokens, int heads, int head_dim, const float* weight, float eps,
               const int64_t* positions, void* stream = nullptr);

// The same over independent pieces of the same tokens and head_dim (an attention site's
// q heads and its kv row), in one launch where each piece takes one: every row as
// norm_rope gives it alone.
struct NormRopePiece {
  float* x;  // [tokens, heads, head_dim]
  int heads;
  const float* weight;  // [head_dim], or null: unweighted
};
constexpr int kMaxNormRopePieces = 2;
void norm_rope(const DeviceRope& rope, std::span<const NormRopePiece> pieces, int64_t tokens, int head_dim, float eps,
               const int64_t* positions, void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu). The plan has
// no rope op: RoPE runs inside the attention sites, so this registers nothing today.
void register_rope(Registry& registry);

}  // namespace keel::cuda
