// The lightning indexer on the GPU (dsv4-forward.md §5.8): the CUDA counterpart of
// ops/attention.h's indexer_select, tested against it. Scoring and the top-k run as two
// kernels behind one call: the scores go to caller-provided scratch, then one block per
// token radix-selects the k-th largest and writes the picked indices in ascending order.
#pragma once

#include <cstdint>

#include "cuda/paged_rows.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// For each query token t (all in device memory): score_w = Σ_h weights[t,h] · ReLU(q[t,h] · keys[w]) · key_dim^-0.5
// for w in [0, visible[t]); writes the indices of the min(k, visible[t]) highest scores, plus index_base, to
// out[out_offsets[t] ...] in ascending index order (ties at the threshold: lower index taken first, as the CPU).
// q [tokens, heads, key_dim], weights [tokens, heads], keys [*, key_dim], visible/out_offsets [tokens] int32.
// `scores` is scratch of tokens * max_visible floats (max_visible ≥ every visible[t]).
// Work is linear in each visible[t] (score blocks past it leave at once); nothing past a
// token's count is written.
// With `paged` (a block table per token: cuda/paged_rows.h) and `base_rows` (device
// array of `tokens` entries), token t scores the rows of its table and offsets its picks
// by base_rows[t]: tokens of several sequences, each with its own paged keys, in one call.
// Asynchronous on `stream`.
void indexer_select(const float* q, const float* weights, int64_t tokens, int heads, int key_dim,
                    const float* keys, const int32_t* visible, int64_t max_visible, int k, int32_t index_base,
                    const int32_t* out_offsets, int32_t* out, float* scores, PagedTables paged = {},
                    const int32_t* base_rows = nullptr, void* stream = nullptr);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_indexer(Registry& registry);

}  // namespace keel::cuda
