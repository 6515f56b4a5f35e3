// The MTP layer and speculative decoding on the GPU, against the CPU (the reference) and
// against the GPU's own plain decoding:
// - the MTP layer's logits on the GPU match the CPU's (bf16-scale tolerance, as the
//   trunk's GPU test) and pick the same argmax, after a prompt past its window;
// - a rewound sequence is, bit for bit, one that ran only the kept tokens;
// - speculative decoding gives exactly the plain GPU decoding's tokens, greedy and
//   sampled, for 1, 2 and 3 drafts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "cuda/speculative_target.h"
#include "model/model.h"
#include "model/speculative.h"
#include "ops/sampling.h"

namespace keel::cuda {
namespace {

std::string source_path(const std::string& rel) {
  const char* root = std::getenv("KEEL_SOURCE_DIR");
  return std::string(root ? root : KEEL_SOURCE_DIR) + "/" + rel;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  return ids;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(GpuSpeculative, DraftMatchesTheCpu) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  ASSERT_TRUE(gpu->has_draft());
  const int64_t V = host->config().vocab_size;
  const std::vector<int32_t> ids = random_ids(100, V, 4);  // past the 64-token window
  const std::span<const int32_t> prompt = std::span(ids).subspan(0, 90);
  CpuSpeculativeTarget cpu(*host);
  GpuSpeculativeTarget dev(*gpu);
  const std::vector<float> trunk_cpu = cpu.prefill(prompt), trunk_gpu = dev.prefill(prompt);
  // The MTP layer over the prompt's positions, then two further drafts from its own output.
  const std::span<const int32_t> next = std::span(ids).subspan(1, 90);
  std::vector<std::pair<std::vector<float>, std::vector<float>>> rows{{cpu.draft(next), dev.draft(next)}};
  rows.emplace_back(cpu.draft_more(ids[91]), dev.draft_more(ids[91]));
  rows.emplace_back(cpu.draft_more(ids[92]), dev.draft_more(ids[92]));
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& [want, got] = rows[r];
    ASSERT_EQ(got.size(), static_cast<size_t>(V));
    float scale = 0, worst = 0;
    for (int64_t v = 0; v < V; ++v) {
      scale = std::max(scale, std::fabs(want[v]));
      worst = std::max(worst, std::fabs(got[v] - want[v]));
    }
    EXPECT_LT(worst, 1e-3f * scale) << "draft " << r;
    EXPECT_EQ(argmax(got), argmax(want)) << "draft " << r;
  }
  // Undone drafts leave the MTP layer where the first draft left it.
  cpu.undo_drafts();
  dev.undo_drafts();
  EXPECT_TRUE(same_bits(dev.draft_more(ids[91]), rows[1].second));
}

// The fixture model (CSA ratio 4, HCA ratio 8, an 8-token window): prompts of every
// length from 3 to 14 put window closings everywhere in the 4 verified tokens.
TEST(GpuSpeculative, RewindKeepsExactlyTheKeptTokens) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("tests/fixtures/tiny"));
  const auto gpu = GpuModel::create(*host);
  const int64_t V = host->config().vocab_size;
  const std::vector<int32_t> ids = random_ids(32, V, 3);
  const std::span<const int32_t> all(ids);
  DeviceMark mark;
  DeviceJournal journal;
  DeviceBuffer<float> streams;
  for (int64_t prompt = 3; prompt <= 14; ++prompt) {
    for (int64_t keep = 0; keep <= 4; ++keep) {
      DeviceSequence a = gpu->new_sequence(), b = gpu->new_sequence();
      gpu->forward(a, all.subspan(0, prompt));
      gpu->mark(a, 4, mark);
      gpu->verify(a, all.subspan(prompt, 4), LogitRows::all, streams, &journal);
      gpu->rewind(a, mark, journal, keep);
      EXPECT_EQ(a.length, prompt + keep);
      gpu->forward(b, all.subspan(0, prompt));
      if (keep) gpu->forward(b, all.subspan(prompt, keep));
      for (int64_t t = prompt + keep; t < prompt + keep + 6; ++t) {
        ASSERT_TRUE(same_bits(gpu->forward(a, all.subspan(t, 1)), gpu->forward(b, all.subspan(t, 1))))
            << "prompt " << prompt << ", keep " << keep << ", token " << t;
      }
    }
  }
}

TEST(GpuSpeculative, GivesThePlainTokens) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  const std::vector<int32_t> prompt = random_ids(20, host->config().vocab_size, 9);
  const int n = 40;
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{.temperature = 0.8f, .top_p = 0.95f, .seed = 11}}) {
    Sampler plain(p);
    DeviceSequence seq = gpu->new_sequence();
    std::vector<int32_t> want{plain.next(gpu->forward(seq, prompt, LogitRows::last))};
    while (static_cast<int>(want.size()) < n) want.push_back(plain.next(gpu->forward(seq, std::span(&want.back(), 1))));
    for (int k = 1; k <= kMaxDraftTokens; ++k) {
      GpuSpeculativeTarget target(*gpu);
      SpeculativeDecoder spec(target, k);
      Sampler sampler(p);
      const std::vector<int32_t> got = spec.generate(prompt, n, sampler);
      EXPECT_EQ(got, want) << "temperature " << p.temperature << ", " << k << " drafts";
      EXPECT_EQ(spec.stats().tokens, spec.stats().steps + spec.stats().accepted);
    }
  }
}

}  // namespace
}  // namespace keel::cuda
