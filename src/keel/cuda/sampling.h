// Sampling on the GPU: ops/sampling.h's `summarize` as a kernel, so a batch's logits
// stay on the device and only each row's summary (a few candidates and normalizers)
// comes back; the host's `choose` takes the token from it. Tested against
// ops/sampling.h token for token (tests/gpu/test_sampling_cuda.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/sampling.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

// One row's summary as the kernel writes it; the candidates go to separate arrays.
struct RowTotals {
  float max_logit, log_z, z_t, whole_pick_logit;
  int32_t whole_pick, count;
};

// Summarizes `rows` rows of `vocab` logits (device memory, row-major), row r with
// tasks[r] (device memory; candidates 1..kMaxCandidates, at most `stride`). Writes
// totals[r] and the candidates to ids and values at [r · stride, r · stride + count).
// `scratch`: summary_scratch_bytes(rows, vocab) of device memory, 16-byte aligned.
// Asynchronous on `stream`.
void summarize_rows(const float* logits, int64_t rows, int64_t vocab, const SummaryTask* tasks, int stride,
                    RowTotals* totals, int32_t* ids, float* values, void* scratch, void* stream = nullptr);
size_t summary_scratch_bytes(int64_t rows, int64_t vocab);

// Pipelined decode: the next call's tokens picked from this call's summaries on the
// device, where `choose` needs no host (ops/sampling.h's PickKind). sources[r] >= 0
// (pick_source) makes row r of `tokens` ([rows]) the pick of that summary row, and looks
// its experts up for every hash layer: hashed[h, r, :] = tid2eid[h, token, :]
// (tid2eid [hash_layers, vocab, k], hashed [hash_layers, rows, k]); rows with -1 keep
// what they hold. A pick that is not a token (a whole-row pick of -1) becomes token 0;
// the host finds such a row's summary insufficient. Asynchronous on `stream`.
int32_t pick_source(int64_t summary_row, PickKind kind);  // kind: first_candidate or whole_row
void take_picks(const RowTotals* totals, const int32_t* ids, int stride, const int32_t* sources, int64_t rows,
                int64_t vocab, const int32_t* tid2eid, int hash_layers, int k, int32_t* tokens, int32_t* hashed,
                void* stream = nullptr);

// The host's summary of row r from the copied-back arrays.
RowSummary row_summary(const RowTotals& totals, const int32_t* ids, const float* values, int64_t vocab);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_sampling(Registry& registry);

}  // namespace keel::cuda
