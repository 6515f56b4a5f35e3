// The MTP layer and speculative decoding on the GPU, against the CPU (the reference) and
// against the GPU's own plain decoding:
// - the MTP layer's rows on the GPU, as the targets summarize them (the plan's sampling
//   kernel on the GPU, the CPU's reduction there), match the CPU's: the same argmax,
//   the CPU's 32 best tokens among the GPU's 64 with their logits and ln Z within a
//   bf16-scale tolerance (as the trunk's GPU test), after a prompt past its window;
// - a rewound sequence is, bit for bit, one that decoded only the kept tokens;
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

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

bool same_summary(const RowSummary& a, const RowSummary& b) {
  return a.vocab == b.vocab && same_bits(a.max_logit, b.max_logit) && same_bits(a.log_z, b.log_z) &&
         same_bits(a.z_t, b.z_t) && a.whole_pick == b.whole_pick && same_bits(a.whole_pick_logit, b.whole_pick_logit) &&
         a.ids == b.ids && same_bits(a.logits, b.logits);
}

// Rows summarized for the greedy choice with the 64 best tokens listed.
const RowChoice kTop{SamplingParams{}, 0, 64};

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
  cpu.prefill(prompt, kTop);
  dev.prefill(prompt, kTop);
  // The MTP layer over the prompt's positions, then two further drafts from its own output.
  const std::span<const int32_t> next = std::span(ids).subspan(1, 90);
  std::vector<std::pair<RowSummary, RowSummary>> rows{{cpu.draft(next, kTop), dev.draft(next, kTop)}};
  rows.emplace_back(cpu.draft_more(ids[91], kTop), dev.draft_more(ids[91], kTop));
  rows.emplace_back(cpu.draft_more(ids[92], kTop), dev.draft_more(ids[92], kTop));
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& [want, got] = rows[r];
    ASSERT_EQ(got.vocab, V);
    ASSERT_EQ(got.ids.size(), want.ids.size()) << "draft " << r;
    EXPECT_EQ(got.ids.front(), want.ids.front()) << "draft " << r;
    const float scale = std::max({std::fabs(want.max_logit), std::fabs(want.logits.back()), std::fabs(want.log_z)});
    EXPECT_LT(std::fabs(got.log_z - want.log_z), 1e-3f * scale) << "draft " << r;
    for (size_t i = 0; i < 32; ++i) {
      const auto at = std::find(got.ids.begin(), got.ids.end(), want.ids[i]);
      ASSERT_NE(at, got.ids.end()) << "draft " << r << ": the CPU's token " << i << " is not among the GPU's best";
      EXPECT_LT(std::fabs(got.logits[at - got.ids.begin()] - want.logits[i]), 1e-3f * scale) << "draft " << r;
    }
  }
  // Undone drafts leave the MTP layer where the first draft left it.
  cpu.undo_drafts();
  dev.undo_drafts();
  EXPECT_TRUE(same_summary(dev.draft_more(ids[91], kTop), rows[1].second));
}

// The fixture model (CSA ratio 4, HCA ratio 8, an 8-token window): prompts of every
// length from 3 to 14 put window closings everywhere in the 4 verified tokens.
// A verification's kept tokens leave the state plain decoding leaves, one token at a
// time (the planned verify kernel gives a row the decode kernel's bits). The demo model:
// verification is planned for a model with a draft.
TEST(GpuSpeculative, RewindKeepsExactlyTheKeptTokens) {
  if (devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(source_path("models/keel-tiny-v4"));
  const auto gpu = GpuModel::create(*host);
  const int64_t V = host->config().vocab_size;
  const std::vector<int32_t> ids = random_ids(32, V, 3);
  const std::span<const int32_t> all(ids);
  DeviceMark mark;
  DeviceJournal journal;
  DeviceBuffer<float> streams;
  const std::vector<RowChoice> four(4, kTop);
  for (int64_t prompt = 3; prompt <= 14; ++prompt) {
    for (int64_t keep = 0; keep <= 4; ++keep) {
      DeviceSequence a = gpu->new_sequence(), b = gpu->new_sequence();
      gpu->forward(a, all.subspan(0, prompt));
      gpu->mark(a, 4, mark);
      gpu->verify(a, all.subspan(prompt, 4), four, streams, &journal);
      gpu->rewind(a, mark, journal, keep);
      EXPECT_EQ(a.length, prompt + keep);
      gpu->forward(b, all.subspan(0, prompt));
      for (int64_t t = prompt; t < prompt + keep; ++t) gpu->forward(b, all.subspan(t, 1));
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
