// The CUDA MoE elementwise steps: the clamped SwiGLU against ops/moe.h's clamped_swiglu
// on values spanning well past ±limit (and exactly at it, and where exp overflows), and
// the weighted sum of each token's expert outputs against the plain loop, at sizes on
// both sides of the 256-thread blocks and past the capped grid (where threads loop).
//
// Tolerances: CUDA's expf is within 2 ulp and std::exp within 1; the rest (one add, a
// division, a multiply) rounds the same on both sides, so the SwiGLU agrees to a few ulp:
// 1e-6 · (1 + |want|). The weighted sum's multiply-adds may be FMAs on the GPU (one
// rounding instead of two): 1e-6 · (1 + Σ|terms|). A wrong clamp, weight or row is off
// by far more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/moe.h"
#include "gpu/device_memory.h"
#include "ops/moe.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

TEST(CudaMoe, ClampedSwigluMatchesCpuReference) {
  constexpr float kLimit = 7.0f;
  for (const int64_t count : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{3 << 20} + 5}) {
    std::vector<float> gate = random_normal(count, 21, 10.0f), up = random_normal(count, 22, 10.0f);
    if (count > 8) {
      const float edges[] = {kLimit, -kLimit, 1000.0f, -1000.0f, 0.0f, -0.0f, 1e-30f, -200.0f};
      for (int i = 0; i < 8; ++i) gate[i] = edges[i], up[i] = edges[7 - i];
    }
    std::vector<float> want = gate;
    keel::clamped_swiglu(want, up, kLimit);
    float* dgate = device_copy(gate);
    float* dup = device_copy(up);
    clamped_swiglu(dgate, dup, count, kLimit);
    const std::vector<float> got = host_copy(dgate, want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-6f * (1.0f + std::fabs(want[i])))
          << "count " << count << " at " << i << " gate " << gate[i] << " up " << up[i];
    }
    cudaFree(dgate);
    cudaFree(dup);
  }
}

TEST(CudaMoe, CombinePairsMatchesPlainLoop) {
  struct Size {
    int64_t tokens;
    int k;
    int64_t dim;
  };
  for (const auto& [tokens, k, dim] : {Size{1, 6, 7}, Size{37, 6, 300}, Size{700, 8, 3000}}) {
    for (const bool with_shared : {false, true}) {
      const std::vector<float> y = random_normal(tokens * k * dim, 32), weights = random_normal(tokens * k, 33, 0.3f);
      const std::vector<float> shared = random_normal(tokens * dim, 34);
      std::vector<float> want(tokens * dim), bound(tokens * dim);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t d = 0; d < dim; ++d) {
          float sum = with_shared ? shared[t * dim + d] : 0.0f, size = std::fabs(sum);
          for (int j = 0; j < k; ++j) {
            const float term = weights[t * k + j] * y[(t * k + j) * dim + d];
            sum += term;
            size += std::fabs(term);
          }
          want[t * dim + d] = sum;
          bound[t * dim + d] = 1e-6f * (1.0f + size);
        }
      }
      float* dy = device_copy(y);
      float* dweights = device_copy(weights);
      float* dshared = device_copy(shared);
      float* dout = device_poisoned(want.size());
      combine_pairs(dy, dweights, tokens, k, dim, with_shared ? dshared : nullptr, dout);
      const std::vector<float> got = host_copy(dout, want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], bound[i]) << tokens << "x" << k << "x" << dim << " shared " << with_shared
                                               << " at " << i;
      }
      for (float* q : {dy, dweights, dshared, dout}) cudaFree(q);
    }
  }
}

}  // namespace
}  // namespace keel::cuda
