// The CUDA sampling summary against ops/sampling.h's summarize on random rows (and rows
// full of ties, -0 and +0 among them), at vocabularies below, at and across the block's
// thread count and the candidate buffer, with outputs poisoned first: candidates and
// their order exact, the whole-row Gumbel pick exact (the noise is bit-identical by
// construction), the chosen token the same. The normalizers are sums of exp in a
// different order (per 4096-logit chunk relative to its own maximum, strided partials
// and shuffle trees, against one double sum): 1e-5 relative; a sum over the wrong row,
// a missing term or a chunk scaled by the wrong maximum is off by far more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/sampling.h"
#include "gpu/device_memory.h"
#include "ops/sampling.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

// A spread of choices: greedy, greedy with top logprobs, whole-row sampling with and
// without min-p, top-k, top-p (the full candidate buffer), and all filters together.
std::vector<RowChoice> choice_cases(uint64_t seed) {
  return {
      {{.temperature = 0.0f}, 0, 1},
      {{.temperature = 0.0f}, 0, 20},
      {{.temperature = 0.8f, .seed = seed}, 3, 1},
      {{.temperature = 1.0f, .min_p = 0.1f, .seed = seed}, 7, 5},
      {{.temperature = 1.0f, .top_k = 50, .seed = seed}, 1, 1},
      {{.temperature = 1.2f, .top_p = 0.9f, .seed = seed}, 2, 1},
      {{.temperature = 0.7f, .top_k = 300, .top_p = 0.95f, .min_p = 0.01f, .seed = seed}, 9, 1},
  };
}

struct DeviceSummaries {
  std::vector<RowSummary> rows;
  std::vector<RowTotals> totals;
  std::vector<int32_t> ids;
};

DeviceSummaries run_device(const std::vector<float>& logits, int64_t vocab, const std::vector<SummaryTask>& tasks) {
  const auto rows = static_cast<int64_t>(tasks.size());
  int stride = 1;
  for (const SummaryTask& t : tasks) stride = std::max(stride, t.candidates);
  float* d_logits = device_copy(logits);
  SummaryTask* d_tasks = device_copy(tasks);
  auto* d_totals = device_poisoned<RowTotals>(tasks.size());
  auto* d_ids = device_poisoned<int32_t>(tasks.size() * stride);
  float* d_values = device_poisoned(tasks.size() * stride);
  auto* d_scratch = device_poisoned<uint8_t>(summary_scratch_bytes(rows, vocab));
  summarize_rows(d_logits, rows, vocab, d_tasks, stride, d_totals, d_ids, d_values, d_scratch);
  DeviceSummaries out;
  out.totals = host_copy(d_totals, tasks.size());
  out.ids = host_copy(d_ids, tasks.size() * stride);
  const std::vector<float> values = host_copy(d_values, tasks.size() * stride);
  for (int64_t r = 0; r < rows; ++r) {
    out.rows.push_back(row_summary(out.totals[r], out.ids.data() + r * stride, values.data() + r * stride, vocab));
  }
  for (void* p : {static_cast<void*>(d_logits), static_cast<void*>(d_tasks), static_cast<void*>(d_totals),
                  static_cast<void*>(d_ids), static_cast<void*>(d_values), static_cast<void*>(d_scratch)}) {
    cudaFree(p);
  }
  return out;
}

void expect_near_relative(float got, float want, const char* what, int64_t vocab, size_t row) {
  EXPECT_NEAR(got, want, 1e-5f * std::max(1.0f, std::fabs(want))) << what << ", vocab " << vocab << ", row " << row;
}

TEST(CudaSampling, SummariesMatchTheCpuReference) {
  for (const int64_t vocab : {int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{1024}, int64_t{1025}, int64_t{4096},
                              int64_t{4097}, int64_t{50007}, int64_t{129280}}) {
    const std::vector<RowChoice> choices = choice_cases(static_cast<uint64_t>(vocab));
    std::vector<float> logits = random_normal(choices.size() * vocab, static_cast<uint32_t>(vocab), 3.0f);
    for (size_t r = 0; r < choices.size(); ++r) {
      float* row = logits.data() + r * vocab;
      for (int64_t i = 0; i < vocab; ++i) row[i] *= 0.5f + static_cast<float>(r) * 0.25f;
      if (r % 3 == 1) {  // ties everywhere: candidates decided by id, -0 beside +0
        for (int64_t i = 0; i < vocab; ++i) row[i] = std::round(row[i] * 2) / 2;
        for (int64_t i = 0; i < vocab; i += 7) row[i] = (i / 7) % 2 ? -0.0f : 0.0f;
      }
    }
    std::vector<SummaryTask> tasks;
    for (const RowChoice& c : choices) {
      tasks.push_back(summary_task(c));
      tasks.back().candidates = std::min(tasks.back().candidates, kMaxCandidates);
    }
    const DeviceSummaries got = run_device(logits, vocab, tasks);
    for (size_t r = 0; r < choices.size(); ++r) {
      const std::span<const float> row(logits.data() + r * vocab, static_cast<size_t>(vocab));
      const RowSummary want = summarize(row, tasks[r]);
      const RowSummary& g = got.rows[r];
      ASSERT_EQ(g.ids, want.ids) << "vocab " << vocab << ", row " << r;
      ASSERT_EQ(g.logits, want.logits) << "vocab " << vocab << ", row " << r;
      EXPECT_EQ(g.max_logit, want.max_logit) << "vocab " << vocab << ", row " << r;
      EXPECT_EQ(g.whole_pick, want.whole_pick) << "vocab " << vocab << ", row " << r;
      if (want.whole_pick >= 0) {
        EXPECT_EQ(g.whole_pick_logit, want.whole_pick_logit) << "vocab " << vocab << ", row " << r;
      }
      expect_near_relative(g.log_z, want.log_z, "log_z", vocab, r);
      if (choices[r].params.temperature > 0) expect_near_relative(g.z_t, want.z_t, "z_t", vocab, r);
      if (summary_suffices(choices[r].params, g)) {
        EXPECT_EQ(choose(choices[r].params, choices[r].draw, g), choose(choices[r].params, choices[r].draw, want))
            << "vocab " << vocab << ", row " << r;
      }
    }
  }
}

// A row's summary is the same bits alone and among others (what the engine's batch
// invariance rests on).
TEST(CudaSampling, ARowAloneEqualsItInABatch) {
  const int64_t vocab = 4099;
  const std::vector<RowChoice> choices = choice_cases(11);
  const std::vector<float> logits = random_normal(choices.size() * vocab, 77, 2.0f);
  std::vector<SummaryTask> tasks;
  for (const RowChoice& c : choices) tasks.push_back(summary_task(c));
  const DeviceSummaries batch = run_device(logits, vocab, tasks);
  for (size_t r = 0; r < choices.size(); ++r) {
    const std::vector<float> row(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
    const DeviceSummaries alone = run_device(row, vocab, {tasks[r]});
    EXPECT_EQ(std::memcmp(&alone.totals[0], &batch.totals[r], sizeof(RowTotals)), 0) << "row " << r;
    EXPECT_EQ(alone.rows[0].ids, batch.rows[r].ids) << "row " << r;
  }
}

// The next call's tokens picked on the device from the summaries (take_picks) are what
// the host's choose takes from them, for greedy and whole-row rows, and each hash layer's
// experts for them are tid2eid's; rows without a source keep what they held. 300 rows
// (across the kernel's 128-thread blocks), sources in a shuffled order, every fourth row
// without one; tokens and experts poisoned first.
TEST(CudaSampling, PicksOnTheDeviceAreTheHostsChoices) {
  const int64_t vocab = 5003, rows = 300;
  const int hash_layers = 2, k = 6;
  const std::vector<float> logits = random_normal(rows * vocab, 19, 2.5f);
  std::vector<RowChoice> choices;
  for (int64_t r = 0; r < rows; ++r) {
    choices.push_back(r % 2 ? RowChoice{{.temperature = 0.9f, .min_p = r % 3 ? 0.0f : 0.05f, .seed = 5},
                                        static_cast<uint64_t>(r), 1}
                            : RowChoice{{.temperature = 0.0f}, 0, 1 + static_cast<int>(r % 4)});
  }
  std::vector<SummaryTask> tasks;
  int stride = 1;
  for (const RowChoice& c : choices) {
    tasks.push_back(summary_task(c));
    stride = std::max(stride, tasks.back().candidates);
  }
  std::mt19937 rng(4);
  std::vector<int32_t> tid2eid(static_cast<size_t>(hash_layers * vocab * k));
  for (auto& e : tid2eid) e = static_cast<int32_t>(rng() % 256);
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> sources(rows, -1);
  for (int64_t r = 0; r < rows; ++r) {
    if (r % 4 != 3) sources[r] = pick_source(order[r], pick_kind(choices[order[r]].params));
  }

  DeviceScope scope;
  const float* d_logits = scope.copy(logits);
  const SummaryTask* d_tasks = scope.copy(tasks);
  auto* d_totals = scope.copy(std::vector<RowTotals>(rows));
  auto* d_ids = scope.copy(std::vector<int32_t>(rows * stride));
  auto* d_values = scope.copy(std::vector<float>(rows * stride));
  auto* d_scratch = scope.copy(std::vector<uint8_t>(summary_scratch_bytes(rows, vocab)));
  const int32_t* d_sources = scope.copy(sources);
  const int32_t* d_tid2eid = scope.copy(tid2eid);
  auto* d_tokens = scope.copy(std::vector<int32_t>(rows, -7));
  auto* d_hashed = scope.copy(std::vector<int32_t>(static_cast<size_t>(hash_layers * rows * k), -7));
  summarize_rows(d_logits, rows, vocab, d_tasks, stride, d_totals, d_ids, d_values, d_scratch);
  take_picks(d_totals, d_ids, stride, d_sources, rows, vocab, d_tid2eid, hash_layers, k, d_tokens, d_hashed);
  const std::vector<RowTotals> totals = host_copy(d_totals, rows);
  const std::vector<int32_t> ids = host_copy(d_ids, rows * stride);
  const std::vector<float> values = host_copy(d_values, rows * stride);
  const std::vector<int32_t> tokens = host_copy(d_tokens, rows);
  const std::vector<int32_t> hashed = host_copy(d_hashed, hash_layers * rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    if (sources[r] < 0) {
      EXPECT_EQ(tokens[r], -7) << "row " << r;
      for (int h = 0; h < hash_layers; ++h) EXPECT_EQ(hashed[(h * rows + r) * k], -7) << "row " << r;
      continue;
    }
    const int64_t from = order[r];
    const RowSummary summary = row_summary(totals[from], ids.data() + from * stride, values.data() + from * stride, vocab);
    ASSERT_TRUE(summary_suffices(choices[from].params, summary)) << "row " << r;
    const int32_t want = choose(choices[from].params, choices[from].draw, summary);
    ASSERT_EQ(tokens[r], want) << "row " << r;
    for (int h = 0; h < hash_layers; ++h) {
      for (int e = 0; e < k; ++e) {
        EXPECT_EQ(hashed[(h * rows + r) * k + e], tid2eid[(h * vocab + want) * k + e]) << "row " << r << ", layer " << h;
      }
    }
  }
}

}  // namespace
}  // namespace keel::cuda
