// RMSNorm on the GPU (dsv4-forward.md §2.1, §2.2): the CUDA counterpart of ops/norm.h,
// tested against it. f32 rows in device memory, one block per row, asynchronous on
// `stream` (0: the default stream).
#pragma once

#include <cstdint>

#include "plan/kernel_registry.h"

namespace keel::cuda {

// out[r] = weight ⊙ x[r] · rsqrt(mean(x[r]²) + eps) for each of `rows` rows of `dim`
// floats. `out` may alias `x`.
void rms_norm(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t dim,
              void* stream = nullptr);

// x[r] ← x[r] · rsqrt(mean(x[r]²) + eps), in place; per query head: rows = tokens · heads,
// dim = head_dim.
void rms_norm_unweighted(float* x, float eps, int64_t rows, int64_t dim, void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_norm(Registry& registry);

}  // namespace keel::cuda
