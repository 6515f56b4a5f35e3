// The MTP layer and speculative decoding on the CPU.
// - The MTP layer of keel-tiny-v4 against the torch MTP module it was trained with
//   (tools/make_mtp_fixture.py: transformers 5.17.0's decoder block, float32): the
//   trunk streams it takes, its logits at 14 positions, its argmax at every position.
// - Rewinding: a sequence that ran tokens and was rewound to keep some of them is, bit
//   for bit, a sequence that ran only those (the next logits are memcmp-equal), with
//   compressor windows closing inside the undone and the kept tokens.
// - Speculative decoding gives exactly the tokens of decoding without it, greedy and
//   sampled, for 1, 2 and 3 drafts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/speculative.h"
#include "ops/sampling.h"
#include "testing.h"

namespace keel {
namespace {

const std::string kTiny = std::string(KEEL_SOURCE_DIR) + "/models/keel-tiny-v4";
const std::string kFixtureModel = std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/tiny";
const std::string kMtpReference =
    std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/keel_tiny_v4_mtp_reference.safetensors";

const Model& tiny() {
  static const std::unique_ptr<Model> m = Model::load(kTiny);
  return *m;
}

struct MtpReference {
  std::vector<int32_t> ids = testing::fixture_ints(kMtpReference, "input_ids"),
                       positions = testing::fixture_ints(kMtpReference, "positions"),
                       argmax = testing::fixture_ints(kMtpReference, "mtp_argmax"),
                       stream_positions = testing::fixture_ints(kMtpReference, "stream_positions");
  std::vector<float> logits = testing::fixture_floats(kMtpReference, "mtp_logits"),
                     streams = testing::fixture_floats(kMtpReference, "streams");
};

// As the trunk's own fixture test: float32 on both sides, about 1e-5 apart.
constexpr double kTolerance = 2e-4;

TEST(Mtp, MatchesTheTorchReference) {
  const MtpReference ref;
  const Model& m = tiny();
  ASSERT_TRUE(m.has_draft());
  const int64_t V = m.config().vocab_size, n = static_cast<int64_t>(ref.ids.size());
  const int64_t width = int64_t{m.config().hc_mult} * m.config().hidden_size;
  Sequence seq = m.new_sequence();
  std::vector<float> streams;
  m.forward(seq, ref.ids, LogitRows::last, {.streams = &streams});
  ASSERT_EQ(static_cast<int64_t>(streams.size()), n * width);
  double worst = 0;
  for (size_t i = 0; i < ref.stream_positions.size(); ++i) {
    for (int64_t j = 0; j < width; ++j) {
      worst = std::max(worst, static_cast<double>(std::fabs(streams[ref.stream_positions[i] * width + j] -
                                                            ref.streams[i * width + j])));
    }
  }
  EXPECT_LT(worst, kTolerance) << "streams";
  // Positions 0 .. n-2: the streams at i and token i + 1.
  const std::vector<float> logits =
      m.draft(seq, std::span(streams).subspan(0, (n - 1) * width), std::span(ref.ids).subspan(1, n - 1), LogitRows::all);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), (n - 1) * V);
  EXPECT_EQ(seq.draft_length, n - 1);
  worst = 0;
  for (size_t r = 0; r < ref.positions.size(); ++r) {
    for (int64_t v = 0; v < V; ++v) {
      worst = std::max(worst, static_cast<double>(std::fabs(logits[ref.positions[r] * V + v] - ref.logits[r * V + v])));
    }
  }
  EXPECT_LT(worst, kTolerance) << "MTP logits";
  for (int64_t p = 0; p < n - 1; ++p) {
    EXPECT_EQ(argmax(std::span(logits).subspan(p * V, V)), ref.argmax[p]) << "position " << p;
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The fixture model has CSA (ratio 4) and HCA (ratio 8) layers and an 8-token window:
// prompts of every length from 3 to 20 put window closings everywhere in the 4 tokens
// run and in the ones kept.
TEST(Mtp, RewindKeepsExactlyTheKeptTokens) {
  const auto m = Model::load(kFixtureModel);
  const int64_t V = m->config().vocab_size;
  std::mt19937 rng(3);
  std::vector<int32_t> ids(32);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % V);
  for (int64_t prompt = 3; prompt <= 20; ++prompt) {
    for (int64_t keep = 0; keep <= 4; ++keep) {
      Sequence a = m->new_sequence(), b = m->new_sequence();
      const std::span<const int32_t> all(ids);
      m->forward(a, all.subspan(0, prompt));
      const SequenceMark mark = m->mark(a, 4);
      ForwardJournal journal;
      m->forward(a, all.subspan(prompt, 4), LogitRows::all, {.journal = &journal});
      m->rewind(a, mark, journal, keep);
      EXPECT_EQ(a.length, prompt + keep);
      // b runs the kept tokens as a's verification did (one call), never the others.
      m->forward(b, all.subspan(0, prompt));
      if (keep) m->forward(b, all.subspan(prompt, keep));
      EXPECT_EQ(a.state_bytes(), b.state_bytes()) << prompt << "+" << keep;
      for (int64_t t = prompt + keep; t < prompt + keep + 6; ++t) {
        ASSERT_TRUE(same_bits(m->forward(a, all.subspan(t, 1)), m->forward(b, all.subspan(t, 1))))
            << "prompt " << prompt << ", keep " << keep << ", token " << t;
      }
    }
  }
}

// Tokens of plain decoding: the prompt, then one token per forward.
std::vector<int32_t> plain(const Model& m, std::span<const int32_t> prompt, int n, const SamplingParams& p) {
  Sampler sampler(p);
  Sequence seq = m.new_sequence();
  std::vector<int32_t> out{sampler.next(m.forward(seq, prompt, LogitRows::last))};
  while (static_cast<int>(out.size()) < n) out.push_back(sampler.next(m.forward(seq, std::span(&out.back(), 1))));
  return out;
}

TEST(Mtp, SpeculativeDecodingGivesThePlainTokens) {
  const Model& m = tiny();
  const MtpReference ref;  // a real text's opening as the prompt
  const std::span<const int32_t> prompt = std::span(ref.ids).subspan(0, 20);
  const int n = 40;
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{.temperature = 0.8f, .top_p = 0.95f, .seed = 11}}) {
    const std::vector<int32_t> want = plain(m, prompt, n, p);
    for (int k = 1; k <= kMaxDraftTokens; ++k) {
      CpuSpeculativeTarget target(m);
      SpeculativeDecoder spec(target, k);
      Sampler sampler(p);
      const std::vector<int32_t> got = spec.generate(prompt, n, sampler);
      EXPECT_EQ(got, want) << "temperature " << p.temperature << ", " << k << " drafts";
      const auto& s = spec.stats();
      EXPECT_EQ(s.tokens, s.steps + s.accepted);
      EXPECT_LE(s.accepted, s.drafted);
      EXPECT_GT(s.accepted, 0) << "the trained MTP layer never right";
    }
  }
}

}  // namespace
}  // namespace keel
