// Attention on the GPU (dsv4-forward.md §5.4, §5.8): the CUDA counterparts of
// ops/attention.h's `attend`, tested against it. One query token per row; every
// query head attends to the same single K=V head over a key list (window keys and the
// selected compressed entries) given as row indices into one key buffer, with a learned
// sink logit per head. The inverse RoPE of the output is separate (cuda/rope.h).
#pragma once

#include <cstdint>

#include "cuda/paged_rows.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

constexpr int kMaxAttentionHeadDim = 512;

// For each sequence b and head h (all f32 / int32 in device memory):
//   out[b, h] = Σ_j P_hj · kv[key_index[j]] over j in [key_offsets[b], key_offsets[b + 1]),
//   P_h = softmax({q[b, h] · kv[key_index[j]] · scale}_j ∪ {sinks[h]}) with the sink's
//   share dropped.
// q and out are [sequences, heads, head_dim]; kv is [*, head_dim]; key_offsets has
// sequences + 1 entries, none more than max_keys apart. head_dim ≤ kMaxAttentionHeadDim.
// With `paged` (a block table per sequence: cuda/paged_rows.h), sequence b's key_index
// rows are rows of its table instead of `kv`: sequences with paged state of their own in
// one call.
// Long key lists are split across blocks (flash-decoding) and merged; how a list is
// split depends on its length only, so a sequence's result is the same bits alone and
// beside others. Each head group's last block to finish merges its splits (counted in
// scratch.arrivals), so the call is one launch. Asynchronous on `stream`.
//
// Where split lists keep their pieces, in device memory (both may be null when
// attend_decode_scratch(...) is 0): `partial`, attend_decode_scratch(...) floats, is
// overwritten; `arrivals`, attend_decode_arrivals(...) counters, must be zero before the
// first call, and each call leaves them zero. The tensor-core kernels below merge in a
// launch of their own and use `partial` alone.
struct SplitScratch {
  float* partial = nullptr;
  unsigned* arrivals = nullptr;
};
void attend_decode(const float* q, int sequences, int heads, int head_dim, const float* kv,
                   const int32_t* key_index, const int32_t* key_offsets, const float* sinks, float scale,
                   float* out, SplitScratch scratch, int max_keys, PagedTables paged = {}, void* stream = nullptr);
int64_t attend_decode_scratch(int sequences, int heads, int head_dim, int max_keys);
int64_t attend_decode_arrivals(int sequences, int heads);

// The same call for many query rows (prefill), on tensor cores: a block takes 32 heads
// of one row against 16 keys at a time (mma.sync m16n8k16), every f32 operand split
// into bf16 hi + lo and multiplied as hi·hi + lo·hi + hi·lo, so a product keeps about
// 16 bits (the CPU reference's f32 keeps 24): scores differ from it by at most about
// 2^-15 of scale·Σ_d |q_d·k_d|. Lists over 512 keys are split and merged as above, by
// their length only (the merge a second launch); the scratch it needs is at most
// attend_decode_scratch's.
void attend_mma(const float* q, int rows, int heads, int head_dim, const float* kv, const int32_t* key_index,
                const int32_t* key_offsets, const float* sinks, float scale, float* out, SplitScratch scratch,
                int max_keys, PagedTables paged = {}, void* stream = nullptr);
// The same kernel for decode and verify rows (one or a few per sequence): lists split
// every 32 keys as attend_decode splits them (up to 16 splits), so that a few rows
// still give the GPU blocks; its scratch is attend_decode_scratch's.
void attend_mma_decode(const float* q, int rows, int heads, int head_dim, const float* kv, const int32_t* key_index,
                       const int32_t* key_offsets, const float* sinks, float scale, float* out, SplitScratch scratch,
                       int max_keys, PagedTables paged = {}, void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_attention(Registry& registry);

}  // namespace keel::cuda
