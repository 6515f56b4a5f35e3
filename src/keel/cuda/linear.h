// y = x · Wᵀ on the GPU over a weight in its stored format (f32, bf16, FP8 128x128
// block-scaled, MXFP4, NVFP4), dequantized in registers: the CUDA counterpart of
// ops/linear.h, tested against it. Plain CUDA cores (no tensor cores): this is the
// decode path, bound by reading the weight once; it runs on sm_80 and later. The plan
// prefers cuda/gemm_mma.h's tensor-core kernels for bf16, FP8 and FP4 weights, which
// hand what they do not take to linear() and linear_pairs().
// Activations and outputs are f32 [tokens, in] / [tokens, out] in device memory.
#pragma once

#include <cstdint>

#include "model/weights.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// A weight copied to device memory, with what the kernel needs to read it.
struct DeviceWeight {
  WeightFormat format = WeightFormat::bf16;
  DType dtype = DType::bf16;          // stored dtype of `data`
  const void* data = nullptr;          // device; FP4 codes packed (cuda/fp4_words.h)
  const uint8_t* scale = nullptr;      // device; fp8_block / mxfp4 / nvfp4
  bool f32_scales = false;             // fp8_block with f32 scales
  float global_scale = 1.0f;           // nvfp4
  int64_t out = 0, in = 0;
  int64_t scale_cols = 0;              // fp8_block: scale blocks per row
  int64_t first_row = 0;               // fp8_block: a row view's first stored row (its scale
                                       // blocks count from the stored row 0)
  uint64_t bytes = 0;                  // stored bytes (data + scales)
};

DeviceWeight upload(const Weight& w);  // throws std::runtime_error on CUDA failure
void release(DeviceWeight& w);

// y[t, o] = Σ_k x[t, k] · W[o, k]. Asynchronous on `stream` (0: the default stream).
// The weight is read once per tile of up to 8 tokens. Each token's row of y is bit for
// bit what a call with that token alone gives, whatever the other tokens (and it is
// what linear_pairs gives the token with that weight).
void linear(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream = nullptr);

// Routed experts without a host round trip: for each pair p < pairs (a token and one
// of its routed experts), y[p] = x[p / per_row] · W_{experts[p]}ᵀ with W_e = table[e],
// a device array of n_table weights of one format and shape, described by `like`. A
// pair whose expert is negative, or whose table entry has no data (an expert another
// rank holds), gets zeros. y is [pairs, like.out]. pairs ≤ 65535. `scratch` is device
// memory of linear_pairs_scratch(pairs, n_table) int32s for the forms that group the
// pairs first (cuda/gemm_mma.h's linear_pairs_mma, the other moe_gemm kernel, same
// signature); this one ignores it and n_table.
//
// `ids` says when the expert ids were written. A kernel started early by programmatic
// dependent launch (cuda/launch.cuh) may read settled ids, and the weights they name,
// while the kernel before it still runs; ids the kernel just before wrote it must wait
// for. This form starts after the kernel before it ends either way.
enum class ExpertIds {
  just_written,  // by the kernel just before, or not known
  // Finished before the kernel just before started: a call's uploaded inputs, or the
  // routing with the gate and up projections between (they wait for it before they let
  // the next kernel start).
  settled,
};
void linear_pairs(const DeviceWeight* table, int n_table, const DeviceWeight& like, const int32_t* experts,
                  int64_t pairs, int per_row, const float* x, float* y, int32_t* scratch, void* stream = nullptr,
                  ExpertIds ids = ExpertIds::just_written);

// The int32s of scratch the pair forms (this one and linear_pairs_mma) need for
// `pairs` pairs over n_table experts: the most either takes (linear_pairs_mma's, 4 per
// pair and 1), so one buffer serves whichever the plan chose.
int64_t linear_pairs_scratch(int64_t pairs, int n_table);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_linear(Registry& registry);

}  // namespace keel::cuda
