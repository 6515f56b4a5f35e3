// Expert parallelism over the GPUs present (skipped with fewer than two): the same
// greedy tokens and the logits of one GPU, on the demo model, for prefill then decode.
#if KEEL_HAVE_NCCL
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "parallel/expert_parallel.h"

namespace keel::parallel {
namespace {

std::string demo_model() {
  const char* root = std::getenv("KEEL_SOURCE_DIR");
  return std::string(root ? root : KEEL_SOURCE_DIR) + "/models/keel-tiny-v4";
}

int argmax(std::span<const float> row) {
  return static_cast<int>(std::max_element(row.begin(), row.end()) - row.begin());
}

TEST(ExpertParallel, GreedyDecodeEqualsOneGpu) {
  const int gpus = static_cast<int>(cuda::devices().size());
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs, found " << gpus;
  const auto host = Model::load(demo_model());
  const auto one = cuda::GpuModel::create(*host);
  for (int n = 2; n <= gpus; n *= 2) {
    const auto split = ExpertParallelModel::create(*host, n);
    std::mt19937 rng(3);
    std::vector<int32_t> prompt(150);
    for (auto& id : prompt) id = static_cast<int32_t>(rng() % host->config().vocab_size);
    cuda::DeviceSequence a = one->new_sequence();
    ExpertParallelModel::Sequence b = split->new_sequence();
    std::vector<float> la = one->forward(a, prompt, LogitRows::last);
    std::vector<float> lb = split->forward(b, prompt, LogitRows::last);
    const float scale = std::fabs(la[argmax(la)]);
    for (int step = 0; step < 48; ++step) {
      // Partial sums reach the all-reduce in another order than one GPU's sum over
      // experts, so logits agree to float rounding, and the greedy tokens exactly.
      float max_abs = 0;
      for (size_t i = 0; i < la.size(); ++i) max_abs = std::max(max_abs, std::fabs(la[i] - lb[i]));
      EXPECT_LE(max_abs, 1e-3f * scale) << n << " GPUs, step " << step;
      const int32_t next = argmax(la);
      ASSERT_EQ(next, argmax(lb)) << n << " GPUs, step " << step;
      la = one->forward(a, std::span(&next, 1));
      lb = split->forward(b, std::span(&next, 1));
    }
    EXPECT_GT(split->communication_seconds(), 0.0);
    EXPECT_GT(split->all_reduce_seconds(host->config().hidden_size, 10), 0.0);
  }
}

}  // namespace
}  // namespace keel::parallel
#endif
