// An mHC site's expand of one channel (cuda/mhc.h's hyper_expand), for the expand kernel
// and for the tensor-core products that expand their rows as they finish them
// (linear_mma_expand): one expression in one place, so both give the same bits.
#pragma once

#include <cstdint>

#include "cuda/mhc.h"

namespace keel::cuda {

// The MoE's output at channel d of token t as cuda::combine_pairs rounds it, before the
// shared expert's: Σ_{i<k} weights[t·k + i] · pairs[(t·k + i)·dim + d]. The loads of up to
// 8 pairs go out before the first is added (one round trip, not k), the sum in i order.
__device__ __forceinline__ float pairs_sum(const float* pairs, const float* weights, int k, int64_t t, int64_t d,
                                           int64_t dim) {
  constexpr int kBatch = 8;
  float sum = 0.0f;
  for (int i0 = 0; i0 < k; i0 += kBatch) {
    float w[kBatch], p[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t pair = t * k + i0 + i;
      w[i] = i0 + i < k ? weights[pair] : 0.0f;
      p[i] = i0 + i < k ? pairs[pair * dim + d] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (i0 + i < k) sum += w[i] * p[i];
    }
  }
  return sum;
}

// Channel s (of a token's hc streams, dim apart) after the expand of y, the sublayer's
// output there: s[k·dim] ← post[k] · y + Σ_j comb[j·hc + k] · s[j·dim]. Every old value is
// read and every new one computed before the first store (in place is safe, and the loads
// are not held behind stores that might alias them); the arrays are unrolled over
// kMaxHyperStreams so that they stay in registers.
__device__ __forceinline__ void expand_channel(const float* post, const float* comb, float y, float* s, int hc,
                                               int64_t dim) {
  float old[kMaxHyperStreams], fresh[kMaxHyperStreams];
#pragma unroll
  for (int j = 0; j < kMaxHyperStreams; ++j) old[j] = j < hc ? s[j * dim] : 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxHyperStreams; ++k) {
    if (k >= hc) break;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxHyperStreams; ++j) {
      if (j < hc) sum += comb[j * hc + k] * old[j];
    }
    fresh[k] = post[k] * y + sum;
  }
#pragma unroll
  for (int k = 0; k < kMaxHyperStreams; ++k) {
    if (k < hc) s[k * dim] = fresh[k];
  }
}

}  // namespace keel::cuda
