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
#include <cstring>
#include <map>
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

// Two pieces in one launch (a layer's routed pairs and its shared expert), of sizes that
// do not end on a block: each comes out bit for bit as clamped_swiglu gives it alone, and
// the floats between them (a poisoned gap in the same buffer) are left alone.
TEST(CudaMoe, ClampedSwigluPiecesMatchEachAlone) {
  constexpr float kLimit = 7.0f;
  const int64_t first = 6 * 2048 + 3, second = 2048 + 200, gap = 5;
  const std::vector<float> gate = random_normal(first + gap + second, 23, 10.0f);
  const std::vector<float> up = random_normal(first + gap + second, 24, 10.0f);
  float* alone = device_copy(gate);
  float* up_alone = device_copy(up);
  clamped_swiglu(alone, up_alone, first, kLimit);
  clamped_swiglu(alone + first + gap, up_alone + first + gap, second, kLimit);
  std::vector<float> poisoned = gate;
  std::fill_n(poisoned.begin() + first, gap, std::nanf(""));
  float* both = device_copy(poisoned);
  float* up_both = device_copy(up);
  const SwigluPiece pieces[] = {{both, up_both, first}, {both + first + gap, up_both + first + gap, second}};
  clamped_swiglu(pieces, kLimit);
  const std::vector<float> want = host_copy(alone, gate.size()), got = host_copy(both, gate.size());
  for (int64_t i = 0; i < first + gap + second; ++i) {
    if (i >= first && i < first + gap) {
      ASSERT_TRUE(std::isnan(got[i])) << "gap float " << i << " was written";
    } else {
      ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0) << "at " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  for (float* p : {alone, up_alone, both, up_both}) cudaFree(p);
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

// Pairs grouped by expert: `order` is a permutation of the pairs; the groups, expert by
// expert with the unrouted (-1) last, cover it in runs of at most `tile` pairs of their
// expert, as few as that allows. Expert counts from a few to more buckets than the
// kernel's threads (several a thread, the last thread's run short).
TEST(CudaMoe, GroupPairsPartitionsByExpert) {
  std::mt19937 rng(9);
  for (const int experts : {4, 256, 1500, 4096}) {
    for (const int64_t pairs : {int64_t{1}, int64_t{7}, int64_t{300}, int64_t{5000}}) {
      for (const int tile : {8, 32}) {
        std::vector<int32_t> ids(pairs);
        std::uniform_int_distribution<int32_t> pick(-1, experts - 1);
        for (auto& e : ids) e = pick(rng);
        int32_t* dids = device_copy(ids);
        int32_t* dorder = device_poisoned<int32_t>(pairs);
        PairGroup* dgroups = device_poisoned<PairGroup>(pairs);
        int32_t* dcount = device_poisoned<int32_t>(1);
        group_pairs(dids, pairs, experts, tile, dorder, dgroups, dcount);
        const std::vector<int32_t> order = host_copy(dorder, pairs);
        const int32_t count = host_copy(dcount, 1)[0];
        ASSERT_GT(count, 0);
        ASSERT_LE(count, pairs);
        const std::vector<PairGroup> groups = host_copy(dgroups, count);
        std::vector<int32_t> sorted = order;
        std::sort(sorted.begin(), sorted.end());
        for (int64_t p = 0; p < pairs; ++p) ASSERT_EQ(sorted[p], p) << "order is not a permutation";
        std::map<int32_t, int64_t> per_expert;
        for (int32_t e : ids) ++per_expert[e];
        int64_t expected_groups = 0;
        for (const auto& [e, n] : per_expert) expected_groups += (n + tile - 1) / tile;
        EXPECT_EQ(count, expected_groups);
        int32_t at = 0, last_expert = -2;
        for (const PairGroup& g : groups) {
          EXPECT_EQ(g.first, at);
          ASSERT_GE(g.count, 1);
          ASSERT_LE(g.count, tile);
          const int32_t rank = g.expert < 0 ? experts : g.expert;
          EXPECT_GE(rank, last_expert) << "groups out of expert order";
          last_expert = rank;
          for (int32_t i = g.first; i < g.first + g.count; ++i) EXPECT_EQ(ids[order[i]], g.expert) << "pair " << order[i];
          at += g.count;
        }
        EXPECT_EQ(at, pairs);
        for (void* p : {static_cast<void*>(dids), static_cast<void*>(dorder), static_cast<void*>(dgroups),
                        static_cast<void*>(dcount)})
          cudaFree(p);
      }
    }
  }
}

}  // namespace
}  // namespace keel::cuda
