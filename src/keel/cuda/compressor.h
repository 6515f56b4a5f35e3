// Compressed attention entries on the GPU (dsv4-forward.md §5.6, §5.7): the CUDA
// counterpart of ops/compressor.h's pool_slots, tested against it.
#pragma once

#include <cstdint>

#include "plan/kernel_registry.h"

namespace keel::cuda {

// For each of `entries` windows: out[e, c] = Σ_s softmax_s(gates[e, s, c]) · values[e, s, c]
// over `slots` rows of `dim` (f32 in device memory; values, gates [entries, slots, dim],
// out [entries, dim]). Asynchronous on `stream`.
void pool_slots(const float* values, const float* gates, int64_t entries, int slots, int dim, float* out,
                void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_compressor(Registry& registry);

}  // namespace keel::cuda
