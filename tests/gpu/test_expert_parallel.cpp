// Expert parallelism over the GPUs present (skipped with fewer than two): the same
// greedy tokens and the logits of one GPU, on the demo model, for prefill then decode;
// and speculative decoding with the MTP layer split like the trunk.
#if KEEL_HAVE_NCCL
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "model/speculative.h"
#include "ops/sampling.h"
#include "parallel/expert_parallel.h"
#include "parallel/parallel_speculative.h"

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

// A batch of sequences split over the GPUs: each sequence's greedy tokens equal its own
// run on one GPU, with prompts prefilled in one batched call and decode steps batched.
TEST(ExpertParallel, BatchedDecodeEqualsOneGpu) {
  const int gpus = static_cast<int>(cuda::devices().size());
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs, found " << gpus;
  const auto host = Model::load(demo_model());
  const auto one = cuda::GpuModel::create(*host);
  const auto split = ExpertParallelModel::create(*host, 2);
  const int64_t V = host->config().vocab_size;
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts{std::vector<int32_t>(90), std::vector<int32_t>(33),
                                            std::vector<int32_t>(7)};
  for (auto& p : prompts) {
    for (auto& id : p) id = static_cast<int32_t>(rng() % V);
  }
  std::vector<ExpertParallelModel::Sequence> seqs;
  std::vector<ExpertParallelModel::Chunk> chunks;
  for (size_t i = 0; i < prompts.size(); ++i) seqs.push_back(split->new_sequence());
  for (size_t i = 0; i < prompts.size(); ++i) chunks.push_back({&seqs[i], prompts[i]});
  std::vector<std::vector<float>> logits = split->forward(chunks, LogitRows::last);
  for (size_t i = 0; i < prompts.size(); ++i) {
    cuda::DeviceSequence alone = one->new_sequence();
    std::vector<float> want = one->forward(alone, prompts[i], LogitRows::last);
    std::vector<int32_t> tokens{argmax(logits[i])};
    ASSERT_EQ(tokens.back(), argmax(want)) << "sequence " << i;
    for (int step = 0; step < 16; ++step) {
      want = one->forward(alone, std::span(&tokens.back(), 1));
      tokens.push_back(argmax(want));
    }
    prompts[i] = tokens;  // the greedy continuation one GPU makes
  }
  for (int step = 0; step < 16; ++step) {
    chunks.clear();
    for (size_t i = 0; i < seqs.size(); ++i) chunks.push_back({&seqs[i], std::span(&prompts[i][step], 1)});
    logits = split->forward(chunks);
    for (size_t i = 0; i < seqs.size(); ++i) ASSERT_EQ(argmax(logits[i]), prompts[i][step + 1]) << i << ", " << step;
  }
}

// The MTP layer's experts split over 2 GPUs: speculative decoding gives exactly the
// tokens of plain decoding on the same 2 GPUs (2 ranks' partial sums add in either
// order to the same bits), greedy and sampled, and the drafts are accepted as often as
// a trained MTP layer's should be.
TEST(ExpertParallel, SpeculativeDecodingGivesThePlainTokens) {
  const int gpus = static_cast<int>(cuda::devices().size());
  if (gpus < 2) GTEST_SKIP() << "needs two GPUs, found " << gpus;
  const auto host = Model::load(demo_model());
  const auto split = ExpertParallelModel::create(*host, 2);
  std::mt19937 rng(9);
  std::vector<int32_t> prompt(20);
  for (auto& id : prompt) id = static_cast<int32_t>(rng() % host->config().vocab_size);
  const int n = 32;
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{.temperature = 0.8f, .top_p = 0.95f, .seed = 11}}) {
    Sampler plain(p);
    ExpertParallelModel::Sequence seq = split->new_sequence();
    std::vector<int32_t> want{plain.next(split->forward(seq, prompt, LogitRows::last))};
    while (static_cast<int>(want.size()) < n) want.push_back(plain.next(split->forward(seq, std::span(&want.back(), 1))));
    ParallelSpeculativeTarget target(*split);
    SpeculativeDecoder spec(target, 3);
    Sampler sampler(p);
    const std::vector<int32_t> got = spec.generate(prompt, n, sampler);
    EXPECT_EQ(got, want) << "temperature " << p.temperature;
    EXPECT_GT(spec.stats().accepted, 0);
  }
}

}  // namespace
}  // namespace keel::parallel
#endif
