// The CUDA lightning indexer against ops/attention.h's indexer_select: several tokens per
// call with visible counts around k (0, 1, k − 1, k, k + 1), across the key tiles and the
// top-k's chunks (thousands, tens of thousands), at Flash's shape and a small odd one;
// duplicate keys for exact ties; outputs poisoned, a sentinel after each token's slots.
//
// The picked sets must match exactly, but for keys on the threshold's edge: both sides
// score in f32 and sum the heads' 128-term dot products in different orders, which moves
// a score by ~1e-7 relative (random-walk rounding over ~200 additions). So where the
// CPU's k-th score and a neighbour are closer than that, either may be picked. A key
// picked by one side only is accepted iff its score, recomputed in double, lies within
// 1e-5 relative of the CPU's k-th (also in double): ~100× the rounding, yet well below
// the typical gap between neighbouring top scores (~1e-4 relative at 45000 keys), so a
// wrong scale, head, weight or index still fails. Exact ties (duplicate keys) score the
// same bits on both sides, so there the lower-index rule is checked with no slack.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

#include "cuda/indexer.h"
#include "gpu/device_memory.h"
#include "ops/attention.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

constexpr int32_t kBase = 1000;  // index_base: a missing offset shows as an index below it

struct Inputs {
  int heads, key_dim, k;
  std::vector<int32_t> visible;  // per token
  std::vector<float> q, weights, keys;

  std::span<const float> q_of(size_t t) const {
    return std::span<const float>(q).subspan(t * heads * key_dim, size_t(heads) * key_dim);
  }
  std::span<const float> weights_of(size_t t) const {
    return std::span<const float>(weights).subspan(t * heads, heads);
  }
};

// Runs the GPU indexer over every token in one call; returns each token's picks minus
// kBase, after checking that they are ascending, in range, and that the slot after them
// (left between tokens) still holds the poison.
void run_gpu(const Inputs& in, std::vector<std::vector<int64_t>>& picks) {
  const size_t tokens = in.visible.size();
  std::vector<int32_t> offsets, counts;
  int32_t slots = 0;
  for (const int32_t v : in.visible) {
    offsets.push_back(slots);
    counts.push_back(std::min(in.k, std::max(v, 0)));
    slots += counts.back() + 1;  // + the sentinel
  }
  const int64_t max_visible = *std::max_element(in.visible.begin(), in.visible.end());

  float* dq = device_copy(in.q);
  float* dweights = device_copy(in.weights);
  float* dkeys = device_copy(in.keys);
  int32_t* dvisible = device_copy(in.visible);
  int32_t* doffsets = device_copy(offsets);
  int32_t* dout = device_poisoned<int32_t>(slots);  // -1
  float* dscores = device_poisoned(std::max<size_t>(tokens * max_visible, 1));
  indexer_select(dq, dweights, static_cast<int64_t>(tokens), in.heads, in.key_dim, dkeys, dvisible, max_visible,
                 in.k, kBase, doffsets, dout, dscores);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int32_t> out = host_copy(dout, slots);
  // Again with paged keys and an index base per token (tokens of several sequences in one
  // call): each token reads the keys through a block table of its own (blocks of 5 rows,
  // stored out of order), token t's base is kBase + 7t.
  {
    DeviceScope scope;
    std::vector<const float* const*> tables(tokens);
    std::vector<int32_t> bases(tokens);
    for (size_t t = 0; t < tokens; ++t) {
      tables[t] = scattered_table(scope, in.keys, in.key_dim, 5);
      bases[t] = kBase + 7 * static_cast<int32_t>(t);
    }
    int32_t* dbases = device_copy(bases);
    int32_t* dout2 = device_poisoned<int32_t>(slots);
    indexer_select(dq, dweights, static_cast<int64_t>(tokens), in.heads, in.key_dim, nullptr, dvisible, max_visible,
                   in.k, 0, doffsets, dout2, dscores, PagedTables{scope.copy(tables), 5}, dbases);
    const std::vector<int32_t> out2 = host_copy(dout2, slots);
    for (size_t t = 0; t < tokens; ++t) {
      for (int32_t i = 0; i < counts[t]; ++i) {
        ASSERT_EQ(out2[offsets[t] + i] - 7 * static_cast<int32_t>(t), out[offsets[t] + i]) << "token " << t;
      }
    }
    cudaFree(dbases);
    cudaFree(dout2);
  }
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dweights), static_cast<void*>(dkeys),
                  static_cast<void*>(dvisible), static_cast<void*>(doffsets), static_cast<void*>(dout),
                  static_cast<void*>(dscores)})
    cudaFree(p);

  picks.assign(tokens, {});
  for (size_t t = 0; t < tokens; ++t) {
    for (int32_t i = 0; i < counts[t]; ++i) {
      const int32_t got = out[offsets[t] + i];
      ASSERT_GE(got, kBase) << "token " << t << " slot " << i;
      ASSERT_LT(got, kBase + in.visible[t]) << "token " << t << " slot " << i;
      if (i > 0) {
        ASSERT_GT(got, out[offsets[t] + i - 1]) << "token " << t << " slot " << i << ": not ascending";
      }
      picks[t].push_back(got - kBase);
    }
    ASSERT_EQ(out[offsets[t] + counts[t]], -1) << "token " << t << ": written past its " << counts[t] << " picks";
  }
}

std::vector<int64_t> cpu_picks(const Inputs& in, size_t t) {
  std::vector<const float*> keys;
  for (int64_t w = 0; w < in.visible[t]; ++w) keys.push_back(in.keys.data() + w * in.key_dim);
  return keel::indexer_select(in.q_of(t), in.weights_of(t), in.heads, in.key_dim, keys, in.k);
}

double exact_score(const Inputs& in, size_t t, int64_t w) {
  const std::span<const float> q = in.q_of(t), weights = in.weights_of(t);
  const float* key = in.keys.data() + w * in.key_dim;
  double sum = 0.0;
  for (int h = 0; h < in.heads; ++h) {
    double dot = 0.0;
    for (int d = 0; d < in.key_dim; ++d) dot += double{q[size_t(h) * in.key_dim + d]} * key[d];
    sum += double{weights[h]} * std::max(dot, 0.0);
  }
  return sum / std::sqrt(double(in.key_dim));
}

// The GPU's picks against the CPU's for every token, with the borderline rule above.
void check_against_cpu(const Inputs& in) {
  std::vector<std::vector<int64_t>> got;
  run_gpu(in, got);
  if (::testing::Test::HasFatalFailure()) return;
  for (size_t t = 0; t < in.visible.size(); ++t) {
    const std::vector<int64_t> want = cpu_picks(in, t);  // best first
    std::vector<int64_t> sorted = want;
    std::sort(sorted.begin(), sorted.end());
    ASSERT_EQ(got[t].size(), sorted.size()) << "token " << t;
    if (got[t] == sorted) continue;
    ASSERT_GT(in.visible[t], in.k) << "token " << t << ": all visible entries are picked, no threshold";
    std::vector<int64_t> differ;
    std::set_symmetric_difference(got[t].begin(), got[t].end(), sorted.begin(), sorted.end(),
                                  std::back_inserter(differ));
    const double threshold = exact_score(in, t, want.back());
    for (const int64_t w : differ) {
      const double s = exact_score(in, t, w);
      EXPECT_LE(std::fabs(s - threshold), 1e-5 * std::fabs(threshold))
          << "token " << t << " (visible " << in.visible[t] << "): entry " << w << " scores " << s
          << ", the k-th " << threshold;
    }
  }
}

Inputs random_inputs(int heads, int key_dim, int k, std::vector<int32_t> visible, uint32_t seed) {
  const size_t tokens = visible.size();
  const int64_t rows = std::max<int64_t>(*std::max_element(visible.begin(), visible.end()), 1);
  return {.heads = heads,
          .key_dim = key_dim,
          .k = k,
          .visible = std::move(visible),
          .q = random_normal(tokens * heads * key_dim, seed),
          .weights = random_normal(tokens * heads, seed + 1),
          .keys = random_normal(rows * key_dim, seed + 2)};
}

TEST(CudaIndexer, FlashSizeMatchesCpuReference) {
  // Flash: 64 heads of 128, k 512. Counts around k, past a 64-key tile and a 4096-score
  // chunk, and one long list, in no particular order.
  check_against_cpu(random_inputs(64, 128, 512, {3001, 0, 513, 45001, 1, 512, 511, 4097}, 201));
}

TEST(CudaIndexer, SmallOddShapeMatchesCpuReference) {
  // Heads and key_dim that fill neither a tile's heads nor a channel chunk; k 7.
  check_against_cpu(random_inputs(3, 20, 7, {6, 0, 7, 8, 1, 1000, 65, 4097, 64}, 211));
}

TEST(CudaIndexer, TiesTakeTheLowerIndexFirst) {
  const int heads = 64, key_dim = 128, k = 512;
  std::mt19937 rng(221);
  // Every key the same: every score ties, so the picks are the first k.
  {
    Inputs in = random_inputs(heads, key_dim, k, {5000, 600}, 222);
    for (int64_t w = 1; w < 5000; ++w) std::copy_n(in.keys.begin(), key_dim, in.keys.begin() + w * key_dim);
    std::vector<std::vector<int64_t>> got;
    run_gpu(in, got);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    std::vector<int64_t> first(k);
    std::iota(first.begin(), first.end(), 0);
    for (size_t t = 0; t < got.size(); ++t) EXPECT_EQ(got[t], first) << "token " << t;
  }
  // Keys drawn from 40 distinct rows: 40 well-separated scores, each repeated hundreds of
  // times, so the k-th falls inside a group that is taken only in part. Rounding cannot
  // reorder the groups, so the choice inside that group is the tie rule alone: exact.
  Inputs in = random_inputs(heads, key_dim, k, {12000, 7000, 513}, 223);
  const std::vector<float> pool = random_normal(40 * key_dim, 224);
  std::uniform_int_distribution<int> pick(0, 39);
  std::vector<int> group(12000);
  for (int64_t w = 0; w < 12000; ++w) {
    group[w] = pick(rng);
    std::copy_n(pool.begin() + group[w] * key_dim, key_dim, in.keys.begin() + w * key_dim);
  }
  std::vector<std::vector<int64_t>> got;
  run_gpu(in, got);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  for (size_t t = 0; t < got.size(); ++t) {
    const std::vector<int64_t> want = cpu_picks(in, t);
    std::vector<int64_t> sorted = want;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(got[t], sorted) << "token " << t;
    // The case is only a tie test if the threshold's group was split.
    const int last = group[want.back()];
    const auto members = std::count_if(group.begin(), group.begin() + in.visible[t], [&](int g) { return g == last; });
    const auto taken = std::count_if(want.begin(), want.end(), [&](int64_t w) { return group[w] == last; });
    EXPECT_LT(taken, members) << "token " << t << ": the threshold's group was taken whole";
  }
}

TEST(CudaIndexer, RefusesEmptyShapes) {
  EXPECT_THROW(indexer_select(nullptr, nullptr, 1, 0, 128, nullptr, nullptr, 1, 1, 0, nullptr, nullptr, nullptr),
               std::runtime_error);
  EXPECT_THROW(indexer_select(nullptr, nullptr, 1, 64, 0, nullptr, nullptr, 1, 1, 0, nullptr, nullptr, nullptr),
               std::runtime_error);
}

}  // namespace
}  // namespace keel::cuda
