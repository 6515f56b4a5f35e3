// W8A8: y = x · Wᵀ for FP8 128x128 block-scaled weights with the activations quantized
// to FP8 too, on FP8 tensor cores (mma.sync m16n8k32 e4m3, sm_89 and later): DeepSeek's
// own FP8 GEMM numerics (ops/linear.h's linear_w8a8_reference is the CPU reference).
//
// Each token's row of x is quantized per 1x128 group along k to e4m3 with a power-of-two
// scale, s = 2^ceil(log2(max(amax, 1e-4) / 448)), into a stream-ordered scratch; then a
// warp computes 32 weight rows by 8 or 32 tokens, one 16x8x32 MMA per 32 k from a zero
// accumulator, added in f32; each 128-k block's sum times the weight's and the token's
// block scales goes into the f32 total. A product of two FP8 values is exact; what the
// MMA rounds is the sum of its 32 products.
//
// Against the bf16 hi + lo path (cuda/gemm_mma.h) this reads x as 1 byte instead of
// two bf16 halves and issues one MMA per 32 k instead of four: the prefill kernel. The
// price is the quantization of x (3 significant bits), as in every FP8 serving stack.
// As there, a token's row is bit for bit the same whatever the other tokens of the call.
#pragma once

#include <cstdint>

#include "cuda/linear.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// Whether linear_w8a8 runs this product on the FP8 tensor cores: an FP8 e4m3 weight
// whose `in` is a whole number of 128-k blocks, x and the weight 16-byte aligned.
bool linear_w8a8_takes(const DeviceWeight& w, const float* x);

// y[t, o] = Σ_k x[t, k] · W[o, k] as above, x [tokens, in] and y [tokens, out] f32 in
// device memory, asynchronous on `stream`. What linear_w8a8_takes refuses (bf16 weights,
// odd widths) goes to linear_mma unchanged, so one choice serves every dense layer.
// Must run on a GPU of an architecture this build compiled the FP8 kernel for (the
// plan sees to it: register_gemm_fp8 lists only those).
void linear_w8a8(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream = nullptr);

// The activation quantization alone: codes [tokens, in] e4m3, scales [tokens, in / 128]
// f32 (in a multiple of 128), as quant/fp8_block.h's quantize_fp8_activations gives them.
void quantize_activations_fp8(const float* x, int64_t tokens, int64_t in, uint8_t* codes, float* scales,
                              void* stream = nullptr);

// Adds cuda_w8a8_gemm for the architectures this build holds FP8 MMA code for (none in
// a build for sm_80 alone).
void register_gemm_fp8(Registry& registry);

}  // namespace keel::cuda
