// The CUDA router against ops/moe.h: scores (sqrtsoftplus, sigmoid) against
// score_router, and the selection and weights against route() run on the GPU's own
// scores, so an ULP of scoring cannot flip a near-tie between the two sides; biased
// top-k with deliberate ties (the lower expert first), and tid2eid. Outputs poisoned.
//
// Tolerances: scores 1e-6 · (1 + |want|) (expf/log1pf/sqrtf against std:: in f32, a few
// ULPs); experts exact; weights 1e-6 relative (the same k-term sum in the same order).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <vector>

#include "cuda/moe_routing.h"
#include "gpu/device_memory.h"
#include "ops/moe.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

void check(int64_t tokens, int experts, int k, ScoringFunc func, bool with_bias, bool hashed_layer, uint32_t seed) {
  std::vector<float> logits = random_normal(tokens * experts, seed, 4.0f);
  logits[0] = 25.0f;  // past softplus's threshold
  std::vector<float> bias = random_normal(experts, seed + 1, 0.1f);
  // Ties in the biased score: experts 3 and 7 (and 10) of token 0 equal.
  if (experts > 10) logits[7] = logits[10] = logits[3] = 30.0f, bias[7] = bias[10] = bias[3] = 0.0f;
  std::vector<int32_t> hashed(tokens * k);
  for (size_t i = 0; i < hashed.size(); ++i) hashed[i] = static_cast<int32_t>((i * 37 + 5) % experts);

  std::vector<float> want_scores = logits;
  score_router(want_scores, func);

  float* dlogits = device_copy(logits);
  float* dbias = device_copy(bias);
  int32_t* dhashed = device_copy(hashed);
  int32_t* dexperts = nullptr;
  float* dweights = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dexperts), tokens * k * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dweights), tokens * k * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(dexperts, 0xff, tokens * k * sizeof(int32_t)), cudaSuccess);  // expert -1
  ASSERT_EQ(cudaMemset(dweights, 0xff, tokens * k * sizeof(float)), cudaSuccess);    // NaN
  const float scaling = 2.5f;
  route(dlogits, tokens, experts, func, with_bias ? dbias : nullptr, hashed_layer ? dhashed : nullptr, k, scaling,
        dexperts, dweights);
  const std::vector<float> scores = host_copy(dlogits, logits.size());
  const std::vector<int32_t> got_experts = host_copy(dexperts, tokens * k);
  const std::vector<float> got_weights = host_copy(dweights, tokens * k);
  for (size_t i = 0; i < scores.size(); ++i) {
    ASSERT_NEAR(scores[i], want_scores[i], 1e-6f * (1.0f + std::fabs(want_scores[i]))) << "score " << i;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const std::span<const float> s(scores.data() + t * experts, experts);
    const Routing want = keel::route(s, with_bias ? std::span<const float>(bias) : std::span<const float>{},
                                     hashed_layer ? std::span<const int32_t>(hashed.data() + t * k, k)
                                                  : std::span<const int32_t>{},
                                     k, scaling);
    for (int i = 0; i < k; ++i) {
      ASSERT_EQ(got_experts[t * k + i], want.experts[i]) << "token " << t << " rank " << i;
      ASSERT_NEAR(got_weights[t * k + i], want.weights[i], 1e-6f * std::fabs(want.weights[i]))
          << "token " << t << " rank " << i;
    }
  }
  // The tie: 3 before 7 before 10 (with sigmoid, expert 0 at logit 25 would join it).
  if (!hashed_layer && experts > 10 && func == ScoringFunc::sqrtsoftplus) {
    EXPECT_EQ(got_experts[0], 3);
    EXPECT_EQ(got_experts[1], 7);
    EXPECT_EQ(got_experts[2], 10);
  }
  cudaFree(dlogits);
  cudaFree(dbias);
  cudaFree(dhashed);
  cudaFree(dexperts);
  cudaFree(dweights);
}

TEST(CudaMoeRouting, SqrtSoftplusBiasedTopK) { check(5, 256, 6, ScoringFunc::sqrtsoftplus, true, false, 111); }
TEST(CudaMoeRouting, SigmoidUnbiasedTopK) { check(3, 64, 8, ScoringFunc::sigmoid, false, false, 121); }
TEST(CudaMoeRouting, MoreExpertsThanThreads) { check(2, 384, 8, ScoringFunc::sqrtsoftplus, true, false, 131); }
TEST(CudaMoeRouting, HashedSelection) { check(4, 256, 6, ScoringFunc::sqrtsoftplus, true, true, 141); }
TEST(CudaMoeRouting, AllExperts) { check(2, 7, 7, ScoringFunc::sigmoid, true, false, 151); }
// More picks than a warp has lanes: the lanes forming the weights each write several.
TEST(CudaMoeRouting, MorePicksThanLanes) { check(3, 300, 40, ScoringFunc::sqrtsoftplus, true, false, 161); }

}  // namespace
}  // namespace keel::cuda
