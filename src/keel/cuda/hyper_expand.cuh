// An mHC site's expand of one channel (cuda/mhc.h's hyper_expand), for the expand kernel
// and for the tensor-core products that expand their rows as they finish them
// (linear_mma_expand): one expression in one place, so both give the same bits.
#pragma once

#include <cstdint>

#include "cuda/mhc.h"

namespace keel::cuda {

// The MoE's output at channel d of token t as cuda::combine_pairs rounds it, before the
// shared expert's: Σ_{i<k} weights[t·k + i] · pairs[(t·k + i)·dim + d].
__device__ __forceinline__ float pairs_sum(const float* pairs, const float* weights, int k, int64_t t, int64_t d,
                                           int64_t dim) {
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += weights[t * k + i] * pairs[(t * k + i) * dim + d];
  return sum;
}

// Channel s (of a token's hc streams, dim apart) after the expand of y, the sublayer's
// output there: s[k·dim] ← post[k] · y + Σ_j comb[j·hc + k] · s[j·dim]. The old values are
// read first, so in place is safe.
__device__ __forceinline__ void expand_channel(const float* post, const float* comb, float y, float* s, int hc,
                                               int64_t dim) {
  float old[kMaxHyperStreams];
  for (int j = 0; j < hc; ++j) old[j] = s[j * dim];
  for (int k = 0; k < hc; ++k) {
    float sum = 0.0f;
    for (int j = 0; j < hc; ++j) sum += comb[j * hc + k] * old[j];
    s[k * dim] = post[k] * y + sum;
  }
}

}  // namespace keel::cuda
