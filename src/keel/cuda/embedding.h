// The token embedding on the GPU (dsv4-forward.md §3): rows of the table decoded from
// their stored format, the CUDA counterpart of ops/linear.h's decode_row (the CPU's
// embedding kernel), tested against it.
#pragma once

#include <cstdint>

#include "cuda/linear.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// out[t, c, :] = row tokens[t] of `table`, decoded from its stored format, for each of
// `copies` copies (the hyper-connection streams start as copies of the embedding).
// tokens [count] int32 device; out [count, copies, table.in] f32 device. Any format
// cuda::linear reads (f32, bf16, fp8_block, mxfp4, nvfp4), and f16 data; decoding is
// exact, equal to decode_row. A token outside [0, table.out) gives a NaN row rather than
// a read out of bounds. Asynchronous on `stream` (0: the default stream).
void embed(const DeviceWeight& table, const int32_t* tokens, int64_t count, int copies, float* out,
           void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_embedding(Registry& registry);

}  // namespace keel::cuda
