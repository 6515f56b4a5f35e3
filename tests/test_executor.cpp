// The executor's pipelined decode (begin_choices, finish_choices) on the CPU: the same
// summaries as the same steps waited for one by one, with tokens taken from the call
// before for the rows whose choice needs no host; and what it refuses. The GPU's own
// begin and finish, which pick on the device, are tested the same way in
// tests/gpu/test_gpu_model.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "model/executor.h"
#include "model/model.h"
#include "ops/sampling.h"
#include "testing.h"

namespace keel {
namespace {

const std::string kFixtureModel = std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/tiny";

using keel::testing::same_summary;

// Sequence 0 greedy, 1 whole-row sampling, 2 top-k every third step (the host gives its
// next token), 3 without a choice on even steps (its tokens come from the host).
std::optional<RowChoice> choice(int i, int step) {
  const auto draw = static_cast<uint64_t>(step);
  switch (i) {
    case 1: return RowChoice{{.temperature = 0.8f, .seed = 9}, draw, 1};
    case 2:
      if (step % 3 == 0) return RowChoice{{.temperature = 1.0f, .top_k = 7, .seed = 2}, draw, 1};
      return RowChoice{};
    case 3:
      if (step % 2 == 0) return std::nullopt;
      return RowChoice{};
    default: return RowChoice{};
  }
}

bool picked(int i, int step) { return choice(i, step) && pick_kind(choice(i, step)->params) != PickKind::candidates; }

TEST(Executor, PipelinedStepsGiveTheWaitedSummaries) {
  const auto model = Model::load(kFixtureModel);
  const CpuExecutor executor(*model);
  constexpr int kSequences = 4, kSteps = 12;
  const int64_t V = model->config().vocab_size;
  std::mt19937 rng(3);
  // tokens[s][i]: what sequence i runs at step s (a host token where the step before has
  // no pick of it); the waited run decides them.
  std::vector<std::vector<int32_t>> tokens(kSteps + 1, std::vector<int32_t>(kSequences));
  for (auto& t : tokens[0]) t = static_cast<int32_t>(rng() % V);
  std::vector<std::vector<std::optional<RowSummary>>> waited;
  std::vector<std::unique_ptr<SequenceState>> a, b;
  for (int i = 0; i < kSequences; ++i) {
    a.push_back(executor.new_sequence());
    b.push_back(executor.new_sequence());
  }
  for (int step = 0; step < kSteps; ++step) {
    std::vector<SequenceChunk> chunks;
    std::vector<std::optional<RowChoice>> choices;
    for (int i = 0; i < kSequences; ++i) {
      chunks.push_back({a[i].get(), std::span(&tokens[step][i], 1)});
      choices.push_back(choice(i, step));
    }
    waited.push_back(executor.forward_choices(chunks, choices));
    for (int i = 0; i < kSequences; ++i) {
      tokens[step + 1][i] = choices[i] ? choose(choices[i]->params, choices[i]->draw, *waited.back()[i])
                                       : static_cast<int32_t>(rng() % V);
    }
  }
  const auto expect_step = [&](const std::vector<std::optional<RowSummary>>& got, int step) {
    ASSERT_EQ(got.size(), static_cast<size_t>(kSequences));
    for (int i = 0; i < kSequences; ++i) {
      ASSERT_EQ(got[i].has_value(), waited[step][i].has_value()) << "step " << step << ", sequence " << i;
      if (got[i]) {
        EXPECT_TRUE(same_summary(*got[i], *waited[step][i])) << "step " << step << ", sequence " << i;
      }
    }
  };
  for (int step = 0; step < kSteps; ++step) {
    std::vector<SequenceChunk> chunks;
    std::vector<std::optional<RowChoice>> choices;
    for (int i = 0; i < kSequences; ++i) {
      const bool pick = step > 0 && picked(i, step - 1);
      chunks.push_back(pick ? SequenceChunk{b[i].get(), {}, i} : SequenceChunk{b[i].get(), std::span(&tokens[step][i], 1)});
      choices.push_back(choice(i, step));
    }
    executor.begin_choices(chunks, choices);
    if (step > 0) expect_step(executor.finish_choices(), step - 1);
  }
  expect_step(executor.finish_choices(), kSteps - 1);
  for (int i = 0; i < kSequences; ++i) EXPECT_EQ(b[i]->length(), kSteps);
}

// A pick with no call begun before, of a chunk whose draw the host makes or that had no
// choice, a chunk with both tokens and a pick, a third call begun, a finish with none.
TEST(Executor, PipelinedStepsRefuseWhatCannotBePicked) {
  const auto model = Model::load(kFixtureModel);
  const CpuExecutor executor(*model);
  const auto a = executor.new_sequence(), b = executor.new_sequence(), c = executor.new_sequence();
  const std::vector<int32_t> prompt{1, 2, 3};
  const std::optional<RowChoice> greedy = RowChoice{}, top_k = RowChoice{{.temperature = 1.0f, .top_k = 5}, 0, 1};
  const std::vector<SequenceChunk> picks_nothing{{a.get(), {}, 0}};
  EXPECT_THROW(executor.begin_choices(picks_nothing, std::vector{greedy}), Error);
  EXPECT_EQ(a->length(), 0);
  const std::vector<SequenceChunk> prompts{{a.get(), prompt}, {b.get(), prompt}, {c.get(), prompt}};
  executor.begin_choices(prompts, std::vector{greedy, top_k, std::optional<RowChoice>{}});
  const int32_t token = 5;
  for (const SequenceChunk& bad : {SequenceChunk{b.get(), {}, 1}, SequenceChunk{b.get(), {}, 2},
                                   SequenceChunk{b.get(), {}, 3}, SequenceChunk{b.get(), std::span(&token, 1), 0}}) {
    const std::vector<SequenceChunk> chunks{{a.get(), {}, 0}, bad};
    EXPECT_THROW(executor.begin_choices(chunks, std::vector{greedy, greedy}), Error);
  }
  const std::vector<SequenceChunk> step{{a.get(), {}, 0}, {b.get(), std::span(&token, 1)}};
  executor.begin_choices(step, std::vector{greedy, greedy});
  EXPECT_THROW(executor.begin_choices(step, std::vector{greedy, greedy}), Error);
  EXPECT_EQ(executor.finish_choices().size(), 3u);
  EXPECT_EQ(executor.finish_choices().size(), 2u);
  EXPECT_THROW(executor.finish_choices(), Error);
  EXPECT_EQ(a->length(), 4);
  EXPECT_EQ(b->length(), 4);
}

}  // namespace
}  // namespace keel
