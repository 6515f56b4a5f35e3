// y = x · Wᵀ on tensor cores (mma.sync m16n8k16, bf16 operands, f32 accumulation) over
// bf16, FP8 128x128 block-scaled, MXFP4 and NVFP4 weights: one entry for every token
// count, decode (one token, bound by reading the weight) as well as batched decode and
// prefill (whose tiles share x through shared memory, see MmaTiles); and its pair form
// for the routed experts, each expert's pairs its columns.
// sm_80 and later.
//
// Weights enter the MMA exactly: e4m3 codes, e2m1 codes times their MX or NVFP4 block
// scale, and bf16 are all exact in bf16 (the FP8 block scale and the NVFP4 global scale
// are applied in f32 afterwards). Activations are split x = hi + lo, both bf16, and both
// halves go through the MMA into the same f32 accumulator: about 16 bits of x, a
// relative error of at most 2^-17 per product, i.e. |y - exact| ≤ 2^-17 · Σ_k |x_k·w_k|
// plus f32 rounding.
//
// Each token is one MMA column, and a column's result never depends on the others; the
// k order, the FP8 block folding and the split of k into shares depend on the weight's
// shape only, whichever tile runs. So a token's output row is bit for bit the same whatever the other tokens
// of the call and however many there are.
#pragma once

#include <cstdint>
#include <span>

#include "cuda/linear.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// y[t, o] = Σ_k x[t, k] · W[o, k] for t < tokens; x [tokens, in], y [tokens, out], f32 in
// device memory; asynchronous on `stream` (0: the default stream). Takes the tensor
// cores when the format is one above, in is a multiple of a step's k (32 for bf16, 64
// for FP8, 128 for FP4) and x and the weight are 16-byte aligned; anything else (f32
// weights, the odd widths of small test models) goes to linear(), the CUDA-core GEMV,
// with that kernel's numerics. Same signature as linear().
void linear_mma(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream = nullptr);

// One product of a group: y = x · Wᵀ.
struct GemmProduct {
  const DeviceWeight* w;
  float* y;
};

// Every product of the group over the same x ([tokens, in], each weight's in), each
// bit for bit what linear_mma gives it: with up to 8 tokens, the bf16 and FP8 ones that
// linear_mma takes on the tensor cores run in one launch (up to 8 products a launch,
// both formats mixed), the GPU filled by several small weights at once; the others, and
// every product of more tokens, run one after another.
void linear_mma_group(std::span<const GemmProduct> products, const float* x, int64_t tokens, void* stream = nullptr);

// Whether linear_mma computes this product on the tensor cores (rather than handing it
// to linear()).
bool linear_mma_takes(const DeviceWeight& w, const float* x);

// An mHC site's expand (cuda/mhc.h) of a product's rows y, done as each value is finished
// instead of storing it: post [tokens, hc], comb [tokens, hc, hc] and the streams
// [tokens, hc, out] (updated in place) in device memory; with `pairs` set, y is the shared
// expert's rows added to the routed pairs' weighted sum (hyper_expand_pairs' shared).
struct HyperExpandInto {
  const float *post, *comb;
  float* streams;
  int hc;
  const float *pairs = nullptr, *weights = nullptr;  // [tokens·k, out], [tokens·k]
  int k = 0;
};

// linear_mma(w, x, y, tokens), then hyper_expand of y (or hyper_expand_pairs with y as
// the shared expert's rows), in one launch per 8 tokens (it is made for decode steps) and
// with those calls' bits; no y is written. Only for products linear_mma takes on the
// tensor cores (linear_mma_takes), 1 ≤ hc ≤ kMaxHyperStreams; anything else throws.
void linear_mma_expand(const DeviceWeight& w, const float* x, int64_t tokens, const HyperExpandInto& into,
                       void* stream = nullptr);

// The routed experts' pairs on tensor cores (linear_pairs' contract and signature):
// the pairs grouped by expert on the device (group_pairs, into `scratch`), then one
// launch over (row blocks, groups) in which each group's pairs are the MMA columns, so
// an expert's weight is read once per group of up to 8 of its pairs (32 for FP4 and 16
// for the others when there are more than 8 pairs per table entry on average). Up to 8
// pairs (one token's experts) skip the grouping: each pair is its own group. Each
// pair's row is bit for bit what linear_mma gives with its expert's weight on its x row
// alone: a token's result never depends on the batch. `n_table` is the number of table
// entries (expert ids are below it); `scratch` holds linear_pairs_scratch(pairs,
// n_table) int32s of device memory, overwritten. Every entry with data must have like's
// shape and encoding and be 16-byte aligned (upload()'s weights, and row views of them
// at whole rows, are). When linear_mma would not take `like` on the tensor cores (see
// linear_mma_takes), or n_table is not in 1..kMaxGroupedExperts, the pairs go to
// linear_pairs, the CUDA-core GEMV pair form, with its numerics (what linear_mma then
// gives too). pairs ≤ 65535, as for linear_pairs. With settled `ids` (linear_pairs'
// ExpertIds) one token's pairs, ungrouped, read their experts and ask for their first
// weights before they wait for the kernel before; grouped pairs wait first, as the
// grouping is the kernel before them.
void linear_pairs_mma(const DeviceWeight* table, int n_table, const DeviceWeight& like, const int32_t* experts,
                      int64_t pairs, int per_row, const float* x, float* y, int32_t* scratch,
                      void* stream = nullptr, ExpertIds ids = ExpertIds::just_written);

// linear_pairs_mma over two tables of the same shape and encoding (an expert's gate and
// up projections) for the same pairs and x, into y and second_y: one launch, the pairs
// grouped once; each row bit for bit what linear_pairs_mma gives it.
void linear_pairs_mma_two(const DeviceWeight* table, const DeviceWeight* second_table, int n_table,
                          const DeviceWeight& like, const int32_t* experts, int64_t pairs, int per_row, const float* x,
                          float* y, float* second_y, int32_t* scratch, void* stream = nullptr);

// How many warps of a block (1, 2, 4 or 8) share a row tile's k, in contiguous shares of
// 128-k units: a function of the weight's shape only, never of the token count, so
// that a token's sums are the same in every call. It doubles while a one-token product
// has fewer than 2048 warps of 32 rows (16 per SM of a 132-SM GPU: two blocks, what the
// registers allow) and each share keeps at least 2 units of k. (cuda/gemm_fp8.h's
// kernel splits alike.)
int mma_k_split(const DeviceWeight& w);

// Which tile calls of more than 8 tokens (or pairs per expert) take. Automatic: a block
// of 8 row tiles sharing x staged in shared memory once per 128-k unit, where that
// launch still fills the GPU several times over (prefill), else the tile of split warps
// (batched decode). Each warp of the staged tile sums k in the split warps' shares and
// order, so both give the same bits; the other two settings force one (process-wide,
// for tests and benchmarks).
enum class MmaTiles { automatic, staged, split };
void set_mma_tiles(MmaTiles tiles);

// For tests: how many row blocks each block of a one-token pairs launch (up to 8 pairs,
// ungrouped) goes through; 0, the default, takes as many as let its blocks all fit on
// the GPU at once. The bits are the same either way.
void set_pairs_row_blocks(int per_block);

// For tests: the row tiles a warp takes with up to 8 tokens, 1 or 2 (0, the default:
// 2, or 1 where 2 would leave the GPU's multiprocessors a block each at most). The bits
// are the same either way.
void set_few_token_row_tiles(int tiles);

// Adds the kernels to the registry (called from cuda/kernels.cu).
void register_gemm_mma(Registry& registry);

}  // namespace keel::cuda
