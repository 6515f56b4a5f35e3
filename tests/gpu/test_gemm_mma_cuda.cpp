// The tensor-core matrix kernel (cuda/gemm_mma.h) against the CPU reference
// (ops/linear.h's linear_reference, f64 sums over the quant/ dequantizers) for every
// format it takes, at sizes that cross its row tiles, token groups, passes, k shares
// and FP8 scale blocks, outputs poisoned; against itself: every token's row is bit for
// bit what a call with that token alone gives; and for what it does not take, that it
// hands the product to linear() unchanged. The same for the pair form over tables of
// routed experts: each pair's row against the CPU reference and bit for bit against
// linear_mma on its token alone, zeros for unrouted pairs and experts without data.
//
// Tolerance: x enters the MMAs as bf16 hi + lo with |x - hi - lo| ≤ 2^-17·|x| (hi is
// off by at most half a bf16 ulp of x, lo rounds that remainder to 8 bits), the weights
// exactly, so each product is off by at most 2^-17·|x_k·w_k|; the f32 accumulation of a
// chain of at most ~80 MMAs, block folds and share sums here adds at most about as much
// again. The bound checked is 2^-16 · Σ_k |x_k·w_k| per output (the row's scale, from
// the decoded weights); the worst ratio seen is printed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/gemm_mma.h"
#include "cuda/linear.h"
#include "cuda/mhc.h"
#include "gpu/device_memory.h"
#include "gpu/gemm_check.h"
#include "gpu/weight_cases.h"
#include "model/owned_weight.h"
#include "ops/linear.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

constexpr double kTolerance = 0x1p-16;

// Σ_k |x[t, k]·W[first + o, k]| for every token t and row o < out: the scale of each output.
std::vector<double> magnitudes(const Weight& w, const std::vector<float>& x, int64_t tokens, int64_t first,
                               int64_t out) {
  const int64_t in = in_features(w);
  std::vector<double> m(tokens * out);
  std::vector<float> row(in);
  for (int64_t o = 0; o < out; ++o) {
    keel::decode_row(w, first + o, row);
    for (int64_t t = 0; t < tokens; ++t) {
      double s = 0;
      for (int64_t k = 0; k < in; ++k) s += std::fabs(double{x[t * in + k]} * row[k]);
      m[t * out + o] = s;
    }
  }
  return m;
}

const GemmCheck kMma{kTolerance,
                     [](int64_t tokens, int64_t in, uint32_t seed) { return random_normal(tokens * in, seed); },
                     &keel::linear_reference,
                     &magnitudes,
                     &linear_mma_takes,
                     [](const DeviceWeight& w, const float* x, float* y, int64_t tokens) { linear_mma(w, x, y, tokens); }};

class CudaMma : public ::testing::TestWithParam<WeightCase> {};

// Runs `body` with calls of more than 8 tokens forced onto each of the two tiles in turn
// (gemm_mma.h's MmaTiles): at these small shapes the automatic choice would always take
// the split warps' tile. Calls of up to 8 tokens (the one-token calls each row is
// compared with bit for bit among them) take 2 row tiles a warp with the first and 1
// with the second: the automatic choice would always take 1 here.
template <typename Body>
void for_each_tile(Body&& body) {
  for (const auto& [tiles, row_tiles] : {std::pair{MmaTiles::split, 2}, std::pair{MmaTiles::staged, 1}}) {
    set_mma_tiles(tiles);
    set_few_token_row_tiles(row_tiles);
    SCOPED_TRACE(std::string(tiles == MmaTiles::staged ? "staged tile" : "split tile") + ", up to 8 tokens " +
                 std::to_string(row_tiles) + " row tile(s) a warp");
    body();
    if (::testing::Test::HasFatalFailure()) break;
  }
  set_mma_tiles(MmaTiles::automatic);
  set_few_token_row_tiles(0);
}

// body() with one token's pairs launched as many blocks as fit, then with each block
// through 2 and 3 row blocks (the tests' shapes have 2 or 3: blocks with unequal shares
// and one block through all).
template <typename Body>
void for_each_row_blocks_per_block(Body&& body) {
  for (const int per_block : {0, 2, 3}) {
    set_pairs_row_blocks(per_block);
    SCOPED_TRACE(per_block == 0 ? std::string("blocks fitted to the GPU")
                                : std::to_string(per_block) + " row blocks per block");
    body();
    if (::testing::Test::HasFatalFailure()) break;
  }
  set_pairs_row_blocks(0);
}

// out: no multiple of a warp's 32 rows nor of a block's; in: one to several steps, FP8
// scale blocks crossed unevenly (1152 = 9 blocks, 320 ends in half a block), k split
// across 1 to 8 warps in equal and unequal shares.
TEST_P(CudaMma, MatchesCpuReferenceAndOneTokenCalls) {
  const WeightCase& c = GetParam();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  if (is_fp4(c)) {
    shapes = {{261, 512}, {77, 1024}, {45, 256}, {100, 4096}};
  } else {
    shapes = {{261, 1152}, {77, 320}, {45, 256}, {100, 4096}};
  }
  for (const auto& [out, in] : shapes) {
    const OwnedWeight host(random_normal(out * in, 5), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    for_each_tile([&] { check_against_reference(kMma, c.name, host.weight(), w, 0, 20); });
    release(w);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaMma, ::testing::Values(kBf16, kFp8Ue8m0, kFp8F32, kMxfp4, kNvfp4), case_name);

// linear_mma_expand against linear_mma then hyper_expand (with pairs, hyper_expand_pairs
// with the product as the shared rows), bit for bit: random streams, post and comb (hc 4,
// Flash's, and 3), pairs and weights (k 3, and 10 at 3 tokens); 1, 3 and 8 tokens (the
// few-token tile at 2 and 1 row tiles a warp) and 20 (three launches of the few-token
// tile, its pointers moved on; linear_mma's 20 rows from either many-token tile); shapes
// across row tiles and k shares. The streams must change: a fused launch that expanded
// nothing would fail.
TEST_P(CudaMma, ExpandIntoStreamsMatchesProductThenExpand) {
  const WeightCase& c = GetParam();
  const std::vector<std::pair<int64_t, int64_t>> shapes =
      is_fp4(c) ? std::vector<std::pair<int64_t, int64_t>>{{261, 512}, {100, 4096}}
                : std::vector<std::pair<int64_t, int64_t>>{{261, 320}, {100, 4096}};
  uint32_t seed = 200;
  for (const auto& [out, in] : shapes) {
    const OwnedWeight host(random_normal(out * in, 7), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    for (const int hc : {4, 3}) {
      for (const bool with_pairs : {false, true}) {
        for (const int64_t tokens : {1, 3, 8, 20}) {
          const int k = tokens == 3 ? 10 : 3;  // 10: past pairs_sum's batch of 8 loads
          const HyperParams p{.hc = hc, .dim = out, .sinkhorn_iters = 20, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
          DeviceScope scope;
          const float* dx = scope.copy(random_normal(tokens * in, ++seed));
          const float* post = scope.copy(random_normal(tokens * hc, ++seed));
          const float* comb = scope.copy(random_normal(tokens * hc * hc, ++seed, 0.5f));
          const float* pairs = scope.copy(random_normal(tokens * k * out, ++seed));
          const float* weights = scope.copy(random_normal(tokens * k, ++seed, 0.3f));
          const std::vector<float> streams = random_normal(tokens * hc * out, ++seed, 2.0f);
          const auto where = [&] {
            return std::string(c.name) + " " + std::to_string(out) + "x" + std::to_string(in) + " hc " +
                   std::to_string(hc) + (with_pairs ? " with pairs, " : ", ") + std::to_string(tokens) + " tokens";
          };
          for_each_tile([&] {
            float* want = scope.copy(streams);
            float* y = device_poisoned(tokens * out);
            linear_mma(w, dx, y, tokens);
            if (with_pairs) {
              hyper_expand_pairs(p, post, comb, pairs, weights, k, y, want, tokens);
            } else {
              hyper_expand(p, post, comb, y, want, tokens);
            }
            float* got = scope.copy(streams);
            HyperExpandInto into{post, comb, got, hc};
            if (with_pairs) into.pairs = pairs, into.weights = weights, into.k = k;
            linear_mma_expand(w, dx, tokens, into);
            const std::vector<float> a = host_copy(got, streams.size()), b = host_copy(want, streams.size());
            cudaFree(y);
            ASSERT_NE(std::memcmp(a.data(), streams.data(), a.size() * sizeof(float)), 0) << where() << ": unchanged";
            ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << where() << ": differs from linear_mma, then the expand";
          });
        }
      }
    }
    release(w);
  }
}

// A product linear_mma hands to linear() cannot expand on the way: a clear error.
TEST(CudaMmaCases, ExpandRefusesWhatTheTensorCoresDoNotTake) {
  const OwnedWeight host(random_normal(37 * 48, 3), 37, 48, kBf16.format, kBf16.dtype, kBf16.scales);
  DeviceWeight w = upload(host.weight());
  DeviceScope scope;
  const float* x = scope.copy(random_normal(48, 4));
  float* streams = scope.copy(random_normal(4 * 37, 5));
  const float* mix = scope.copy(random_normal(20, 6));
  EXPECT_FALSE(linear_mma_takes(w, x));
  EXPECT_THROW(linear_mma_expand(w, x, 1, {mix, mix + 4, streams, 4}), std::runtime_error);
  release(w);
}

// A row view of an FP8 weight (the grouped output projection's): rows from 100, so
// warp tiles straddle the stored 128-row scale block boundary.
TEST(CudaMmaCases, Fp8RowViewsUseTheStoredScaleBlocks) {
  for (const WeightCase& c : {kFp8Ue8m0, kFp8F32}) {
    const int64_t rows = 300, in = 1152;
    const OwnedWeight host(random_normal(rows * in, 9), rows, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    for (const auto& [first, count] : {std::pair<int64_t, int64_t>{100, 77}, {136, 164}, {7, 250}}) {
      check_against_reference(kMma, c.name, host.weight(), fp8_rows(w, first, count), first, 30);
    }
    release(w);
  }
}

// MXFP4 blocks whose scale passes 2^1 (values past 12) take a second multiply: every
// third of the first 32 rows has such blocks (so its warp takes that path), the other
// warps none.
TEST(CudaMmaCases, MxFp4LargeScales) {
  const int64_t out = 93, in = 1024;
  std::vector<float> values = random_normal(out * in, 13);
  for (int64_t o = 0; o < out; ++o) {
    if (o < 32 && o % 3 == 0) {
      for (int64_t k = 0; k < in; ++k) values[o * in + k] *= (k / 32) % 2 ? 300.0f : 1e4f;
    }
  }
  const OwnedWeight host(values, out, in, kMxfp4.format, kMxfp4.dtype, kMxfp4.scales);
  DeviceWeight w = upload(host.weight());
  check_against_reference(kMma, "mxfp4 large scales", host.weight(), w, 0, 40);
  release(w);
}

// What the tensor-core kernel does not take goes to linear() as it is: f32 weights,
// widths that are no whole number of steps, x not 16-byte aligned. The results are
// linear()'s, bit for bit.
TEST(CudaMmaCases, OtherShapesGoToTheGemv) {
  struct Case {
    WeightCase c;
    int64_t out, in;
    int64_t x_offset;  // floats
  };
  const Case cases[] = {
      {kF32, 37, 256, 0},   {kBf16, 37, 48, 0},   {kFp8Ue8m0, 37, 96, 0}, {kFp8F32, 61, 1120, 0},
      {kMxfp4, 37, 64, 0},  {kNvfp4, 37, 320, 0}, {kBf16, 37, 256, 1},    {kFp8Ue8m0, 37, 256, 2},
  };
  for (const Case& k : cases) {
    const OwnedWeight host(random_normal(k.out * k.in, 3), k.out, k.in, k.c.format, k.c.dtype, k.c.scales);
    DeviceWeight w = upload(host.weight());
    for (const int64_t tokens : {1, 9}) {
      const std::vector<float> x = random_normal(tokens * k.in + k.x_offset, 4);
      float* dx = device_copy(x);
      const float* xs = dx + k.x_offset;
      EXPECT_FALSE(linear_mma_takes(w, xs)) << k.c.name << " " << k.out << "x" << k.in;
      float* mine = device_poisoned(tokens * k.out);
      float* gemv = device_poisoned(tokens * k.out);
      linear_mma(w, xs, mine, tokens);
      linear(w, xs, gemv, tokens);
      const std::vector<float> a = host_copy(mine, tokens * k.out), b = host_copy(gemv, tokens * k.out);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << k.c.name << " " << k.out << "x" << k.in << " tokens " << tokens;
      std::vector<float> want(tokens * k.out);
      keel::linear_reference(host.weight(), keel::ConstRows{x.data() + k.x_offset, tokens, k.in},
                             keel::rows_of(std::span<float>(want), k.out));
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(a[i], want[i], 2e-4f * (1.0f + std::fabs(want[i]))) << k.c.name << " at " << i;
      }
      for (void* p : {static_cast<void*>(dx), static_cast<void*>(mine), static_cast<void*>(gemv)}) cudaFree(p);
    }
    release(w);
  }
}

// A routed expert's table entry for the pair tests: its device weight (null data:
// another rank's) and the host weight it views from row `first` (null without data).
struct Expert {
  DeviceWeight d;
  const Weight* host = nullptr;
  int64_t first = 0;
};

// linear_pairs_mma over `experts` (entry 0 has data: the shape's `like`) for the pairs'
// expert ids, per_row pairs per row of random x, scratch and outputs poisoned. Each
// pair's row: zeros for -1 and for an entry without data; otherwise within the
// tolerance of the CPU reference (its expert over the x rows of its pairs) and, bit
// for bit, what linear_mma gives its expert on its x row alone. The call with the ids
// settled (read before the wait where ungrouped) gives the same bits. `worst` keeps the
// largest error ratio.
void check_pairs(const char* name, const std::vector<Expert>& experts, const std::vector<int32_t>& ids, int per_row,
                 uint32_t seed, double& worst) {
  const int n_table = static_cast<int>(experts.size());
  const DeviceWeight& like = experts[0].d;
  const int64_t out = like.out, in = like.in, pairs = static_cast<int64_t>(ids.size());
  const int64_t tokens = (pairs + per_row - 1) / per_row;
  std::vector<DeviceWeight> entries;
  for (const Expert& e : experts) entries.push_back(e.d);
  DeviceWeight* dtable = device_copy(entries);
  int32_t* dids = device_copy(ids);
  const std::vector<float> x = random_normal(tokens * in, seed);
  float* dx = device_copy(x);
  float* dy = device_poisoned(pairs * out);
  int32_t* scratch = device_poisoned<int32_t>(linear_pairs_scratch(pairs, n_table));
  ASSERT_TRUE(linear_mma_takes(like, dx)) << name << " " << out << "x" << in;
  linear_pairs_mma(dtable, n_table, like, dids, pairs, per_row, dx, dy, scratch);
  const std::vector<float> got = host_copy(dy, pairs * out);
  {  // settled ids: one token's pairs read them before the wait, with the same bits
    float* early = device_poisoned(pairs * out);
    linear_pairs_mma(dtable, n_table, like, dids, pairs, per_row, dx, early, scratch, nullptr, ExpertIds::settled);
    ASSERT_EQ(std::memcmp(host_copy(early, pairs * out).data(), got.data(), got.size() * sizeof(float)), 0)
        << name << " " << out << "x" << in << ", " << pairs << " pairs: settled ids give other bits";
    cudaFree(early);
  }

  std::vector<float> want(pairs * out);
  std::vector<double> scale(pairs * out);
  for (int e = 0; e < n_table; ++e) {
    if (!experts[e].host) continue;
    std::vector<int64_t> mine;
    for (int64_t p = 0; p < pairs; ++p) {
      if (ids[p] == e) mine.push_back(p);
    }
    if (mine.empty()) continue;
    const auto n = static_cast<int64_t>(mine.size());
    std::vector<float> xe(n * in), ye(n * out);
    for (int64_t i = 0; i < n; ++i) std::copy_n(x.data() + mine[i] / per_row * in, in, xe.data() + i * in);
    keel::linear_reference(*experts[e].host, keel::rows_of(std::span<const float>(xe), in),
                           keel::rows_of(std::span<float>(ye), out), {experts[e].first, out});
    const std::vector<double> m = magnitudes(*experts[e].host, xe, n, experts[e].first, out);
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(ye.data() + i * out, out, want.data() + mine[i] * out);
      std::copy_n(m.data() + i * out, out, scale.data() + mine[i] * out);
    }
  }

  const std::vector<float> zeros(out, 0.0f);
  float* alone = device_poisoned(out);
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t e = ids[p];
    const float* row = got.data() + p * out;
    const auto where = [&] {
      return std::string(name) + " " + std::to_string(out) + "x" + std::to_string(in) + " table " +
             std::to_string(n_table) + ", " + std::to_string(pairs) + " pairs, " + std::to_string(per_row) +
             " per row: pair " + std::to_string(p) + " (expert " + std::to_string(e) + ")";
    };
    if (e < 0 || !experts[e].host) {
      ASSERT_EQ(std::memcmp(row, zeros.data(), out * sizeof(float)), 0) << where() << ": not zeros";
      continue;
    }
    for (int64_t o = 0; o < out; ++o) {
      const double err = std::fabs(double{row[o]} - want[p * out + o]);
      ASSERT_LE(err, kTolerance * scale[p * out + o])
          << where() << " row " << o << ": got " << row[o] << ", want " << want[p * out + o];
      worst = std::max(worst, err / scale[p * out + o]);
    }
    if (!compared_alone(p, pairs)) continue;
    ASSERT_EQ(cudaMemset(alone, 0xff, out * sizeof(float)), cudaSuccess);
    linear_mma(experts[e].d, dx + p / per_row * in, alone, 1);
    const std::vector<float> one = host_copy(alone, out);
    ASSERT_EQ(std::memcmp(one.data(), row, out * sizeof(float)), 0) << where() << ": differs from linear_mma alone";
  }
  for (void* q : {static_cast<void*>(dtable), static_cast<void*>(dids), static_cast<void*>(dx),
                  static_cast<void*>(dy), static_cast<void*>(scratch), static_cast<void*>(alone)})
    cudaFree(q);
}

// Routed-expert pairs: tables of 1, 4 and 9 experts, expert 1 another rank's (no data),
// the last of 4 or more never routed to, ids drawn from the others and -1 (repeats
// within a token's pairs too); 1 to 8 pairs (ungrouped: a group per pair) and 9 to 300
// (grouped by expert), 1 or 6 per x row, so groups of one pair up to full and split
// tiles, in both tile sizes (more than 8 pairs per entry takes the larger), one token's
// pairs with blocks going through one or several row blocks; shapes across row blocks,
// k shares (1 to 8 warps) and FP8 scale blocks.
TEST_P(CudaMma, PairsMatchCpuReferenceAndOneTokenCalls) {
  const WeightCase& c = GetParam();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  if (is_fp4(c)) {
    shapes = {{261, 512}, {77, 1024}, {40, 4096}};
  } else {
    shapes = {{261, 320}, {77, 1152}, {40, 4096}};
  }
  std::mt19937 rng(17);
  uint32_t seed = 60;
  for (const auto& [out, in] : shapes) {
    double worst = 0;
    for (const int n_table : {1, 4, 9}) {
      std::vector<std::unique_ptr<OwnedWeight>> hosts;  // weights point into their owners: never moved
      std::vector<DeviceWeight> uploaded;
      std::vector<Expert> experts;
      for (int e = 0; e < n_table; ++e) {
        hosts.push_back(std::make_unique<OwnedWeight>(random_normal(out * in, 50 + e), out, in, c.format, c.dtype,
                                                      c.scales));
        uploaded.push_back(upload(hosts.back()->weight()));
        experts.push_back({uploaded.back(), &hosts.back()->weight()});
      }
      if (n_table > 1) experts[1] = {};  // held by another rank
      std::vector<int32_t> routed{-1};
      for (int e = 0; e < n_table; ++e) {
        if (n_table < 4 || e != n_table - 1) routed.push_back(e);
      }
      std::uniform_int_distribution<size_t> pick(0, routed.size() - 1);
      for (const int per_row : {1, 6}) {
        for (const int64_t pairs : {1, 5, 8, 9, 40, 300}) {
          std::vector<int32_t> ids(pairs);
          for (int32_t& id : ids) id = routed[pick(rng)];
          // More than 8 pairs per table entry take the many-column tiles (gemm_mma.h); fewer
          // take the split warps' tile whatever MmaTiles says, so they run once.
          const auto check = [&] { check_pairs(c.name, experts, ids, per_row, seed, worst); };
          if (pairs > 8 * n_table) {
            for_each_tile(check);
          } else if (pairs <= 8) {
            for_each_row_blocks_per_block(check);
          } else {
            check();
          }
          ++seed;
          if (HasFatalFailure()) return;
        }
      }
      for (DeviceWeight& w : uploaded) release(w);
    }
    std::printf("  %s pairs %lldx%lld: worst error %.2e of sum |x·w|\n", c.name, static_cast<long long>(out),
                static_cast<long long>(in), worst);
  }
}

// The grouped output projection's shape of call: row views of one FP8 weight as the
// table (scale blocks counted from the stored row 0, views straddling them), pair
// t·G + g through view g.
TEST(CudaMmaCases, PairsOverFp8RowViews) {
  for (const WeightCase& c : {kFp8Ue8m0, kFp8F32}) {
    constexpr int kViews = 3;
    const int64_t rows = 100, in = 1152;
    const OwnedWeight host(random_normal(kViews * rows * in, 21), kViews * rows, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    std::vector<Expert> views;
    for (int g = 0; g < kViews; ++g) views.push_back({fp8_rows(w, g * rows, rows), &host.weight(), g * rows});
    double worst = 0;
    for (const int64_t tokens : {1, 5, 64}) {
      std::vector<int32_t> ids(tokens * kViews);
      for (size_t p = 0; p < ids.size(); ++p) ids[p] = static_cast<int32_t>(p % kViews);
      check_pairs(c.name, views, ids, 1, 70 + static_cast<uint32_t>(tokens), worst);
      if (HasFatalFailure()) return;
    }
    release(w);
    std::printf("  %s row views as pairs: worst error %.2e of sum |x·w|\n", c.name, worst);
  }
}

// What the tensor cores do not take goes to linear_pairs, the GEMV pair form, as it
// is: f32 weights, widths that are no whole number of steps, x not 16-byte aligned;
// zeros for -1 and an entry without data there too.
TEST(CudaMmaCases, PairsOfOtherShapesGoToTheGemvPairs) {
  struct Case {
    WeightCase c;
    int64_t out, in;
    int64_t x_offset;  // floats
  };
  const Case cases[] = {{kF32, 37, 256, 0}, {kBf16, 37, 48, 0}, {kFp8F32, 61, 1120, 0},
                        {kMxfp4, 37, 64, 0}, {kBf16, 37, 256, 1}, {kNvfp4, 37, 256, 2}};
  for (const Case& k : cases) {
    constexpr int kExperts = 3, kPerRow = 2;
    std::vector<std::unique_ptr<OwnedWeight>> hosts;
    std::vector<DeviceWeight> table;
    for (int e = 0; e < kExperts; ++e) {
      hosts.push_back(std::make_unique<OwnedWeight>(random_normal(k.out * k.in, 80 + e), k.out, k.in, k.c.format,
                                                    k.c.dtype, k.c.scales));
      table.push_back(upload(hosts.back()->weight()));
    }
    std::vector<DeviceWeight> entries = table;
    entries[1] = {};  // held by another rank
    const std::vector<int32_t> ids{2, 0, 1, 2, -1, 0, 0, 2};
    const auto pairs = static_cast<int64_t>(ids.size());
    const std::vector<float> x = random_normal(pairs / kPerRow * k.in + k.x_offset, 8);
    DeviceWeight* dtable = device_copy(entries);
    int32_t* dids = device_copy(ids);
    float* dx = device_copy(x);
    const float* xs = dx + k.x_offset;
    EXPECT_FALSE(linear_mma_takes(table[0], xs)) << k.c.name << " " << k.out << "x" << k.in;
    float* mine = device_poisoned(pairs * k.out);
    float* gemv = device_poisoned(pairs * k.out);
    int32_t* scratch = device_poisoned<int32_t>(linear_pairs_scratch(pairs, kExperts));
    linear_pairs_mma(dtable, kExperts, table[0], dids, pairs, kPerRow, xs, mine, scratch);
    linear_pairs(dtable, kExperts, table[0], dids, pairs, kPerRow, xs, gemv, nullptr);
    const std::vector<float> a = host_copy(mine, pairs * k.out), b = host_copy(gemv, pairs * k.out);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << k.c.name << " " << k.out << "x" << k.in;
    for (const int64_t p : {2, 4}) {
      for (int64_t o = 0; o < k.out; ++o) ASSERT_EQ(a[p * k.out + o], 0.0f) << k.c.name << " pair " << p;
    }
    for (DeviceWeight& w : table) release(w);
    for (void* q : {static_cast<void*>(dtable), static_cast<void*>(dids), static_cast<void*>(dx),
                    static_cast<void*>(mine), static_cast<void*>(gemv), static_cast<void*>(scratch)})
      cudaFree(q);
  }
}

// Several products of one x in one launch (linear_mma_group): each product's rows bit
// for bit what linear_mma gives that weight alone. The group: bf16 and FP8 (ue8m0 and
// f32 scales, a row view straddling a scale block) at row counts across tiles and k
// splits, with products it leaves to linear_mma (MXFP4, NVFP4, an f32 weight that goes
// to the GEMV) among them, 11 in all so the group takes two launches; 1 to 8 tokens
// (one launch) and 9 and 33 (one by one). Outputs poisoned.
TEST(CudaMmaCases, GroupGivesEachProductItsOwnBits) {
  const int64_t in = 1152;
  struct Member {
    WeightCase c;
    int64_t out;
  };
  const Member members[] = {{kBf16, 1024}, {kFp8Ue8m0, 512}, {kFp8F32, 261}, {kMxfp4, 77},  {kBf16, 45},
                            {kFp8Ue8m0, 2048}, {kF32, 37}, {kBf16, 64},     {kNvfp4, 100}, {kFp8Ue8m0, 33},
                            {kBf16, 256}};
  std::vector<std::unique_ptr<OwnedWeight>> hosts;
  std::vector<DeviceWeight> weights;
  uint32_t seed = 90;
  for (const Member& m : members) {
    hosts.push_back(std::make_unique<OwnedWeight>(random_normal(m.out * in, seed++), m.out, in, m.c.format, m.c.dtype,
                                                  m.c.scales));
    weights.push_back(upload(hosts.back()->weight()));
  }
  // A view of rows 100..299 of the 512-row FP8 weight: its tiles straddle the stored
  // scale blocks.
  weights.push_back(fp8_rows(weights[1], 100, 200));
  for (const int64_t tokens : {1, 3, 8, 9, 33}) {
    const std::vector<float> x = random_normal(tokens * in, seed++);
    float* dx = device_copy(x);
    std::vector<GemmProduct> products;
    std::vector<float*> outputs;
    for (const DeviceWeight& w : weights) {
      outputs.push_back(device_poisoned(tokens * w.out));
      products.push_back({&w, outputs.back()});
    }
    linear_mma_group(products, dx, tokens);
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t n = tokens * weights[i].out;
      float* alone = device_poisoned(n);
      linear_mma(weights[i], dx, alone, tokens);
      const std::vector<float> want = host_copy(alone, n), got = host_copy(outputs[i], n);
      ASSERT_TRUE(std::none_of(got.begin(), got.end(), [](float v) { return std::isnan(v); }))
          << "product " << i << ": an output left unwritten";
      ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0)
          << "product " << i << " (" << weights[i].out << "x" << in << ") of the group, " << tokens << " tokens";
      cudaFree(alone);
      cudaFree(outputs[i]);
    }
    cudaFree(dx);
  }
  weights.pop_back();  // the view
  for (DeviceWeight& w : weights) release(w);
}

// An expert's gate and up projections in one launch (linear_pairs_mma_two): each table's
// rows bit for bit what linear_pairs_mma gives it alone, for every format, ungrouped
// (up to 8 pairs) and grouped pairs in both tile sizes, with unrouted pairs and an
// entry without data; and for a shape the tensor cores do not take (the GEMV pairs).
TEST_P(CudaMma, TwoTablesInOneLaunchKeepTheirBits) {
  const WeightCase& c = GetParam();
  const int64_t out = 261, in = is_fp4(c) ? 512 : 320;
  constexpr int kExperts = 5;
  std::vector<std::unique_ptr<OwnedWeight>> hosts;
  std::vector<DeviceWeight> uploaded;
  for (int e = 0; e < 2 * kExperts; ++e) {
    hosts.push_back(std::make_unique<OwnedWeight>(random_normal(out * in, 110 + e), out, in, c.format, c.dtype,
                                                  c.scales));
    uploaded.push_back(upload(hosts.back()->weight()));
  }
  std::vector<DeviceWeight> gate(uploaded.begin(), uploaded.begin() + kExperts),
      up(uploaded.begin() + kExperts, uploaded.end());
  gate[2] = {}, up[2] = {};  // another rank's expert
  DeviceWeight* dgate = device_copy(gate);
  DeviceWeight* dup = device_copy(up);
  std::mt19937 rng(23);
  std::uniform_int_distribution<int32_t> pick(-1, kExperts - 1);
  for (const int per_row : {1, 6}) {
    for (const int64_t pairs : {1, 6, 8, 9, 40, 300}) {
      std::vector<int32_t> ids(pairs);
      for (int32_t& id : ids) id = pick(rng);
      const int64_t tokens = (pairs + per_row - 1) / per_row;
      int32_t* dids = device_copy(ids);
      float* dx = device_copy(random_normal(tokens * in, 130 + static_cast<uint32_t>(pairs)));
      int32_t* scratch = device_poisoned<int32_t>(linear_pairs_scratch(pairs, kExperts));
      float *y1 = device_poisoned(pairs * out), *y2 = device_poisoned(pairs * out);
      float *want1 = device_poisoned(pairs * out), *want2 = device_poisoned(pairs * out);
      const auto check = [&] {
        linear_pairs_mma_two(dgate, dup, kExperts, uploaded[0], dids, pairs, per_row, dx, y1, y2, scratch);
        linear_pairs_mma(dgate, kExperts, uploaded[0], dids, pairs, per_row, dx, want1, scratch);
        linear_pairs_mma(dup, kExperts, uploaded[0], dids, pairs, per_row, dx, want2, scratch);
        for (const auto& [got, want] : {std::pair{y1, want1}, std::pair{y2, want2}}) {
          const std::vector<float> a = host_copy(got, pairs * out), b = host_copy(want, pairs * out);
          ASSERT_TRUE(std::none_of(a.begin(), a.end(), [](float v) { return std::isnan(v); }))
              << c.name << ": an output left unwritten";
          ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
              << c.name << ": " << pairs << " pairs, " << per_row << " per row, table " << (got == y1 ? 1 : 2);
        }
      };
      if (pairs > 8 * kExperts) {
        for_each_tile(check);
      } else if (pairs <= 8) {
        for_each_row_blocks_per_block(check);
      } else {
        check();
      }
      for (void* q : {static_cast<void*>(dids), static_cast<void*>(dx), static_cast<void*>(scratch),
                      static_cast<void*>(y1), static_cast<void*>(y2), static_cast<void*>(want1),
                      static_cast<void*>(want2)})
        cudaFree(q);
      if (HasFatalFailure()) break;
    }
  }
  cudaFree(dgate);
  cudaFree(dup);
  for (DeviceWeight& w : uploaded) release(w);

  // A width the tensor cores do not take: both tables through the GEMV pair form.
  const int64_t odd_in = is_fp4(c) ? 64 : 48;
  const OwnedWeight a(random_normal(37 * odd_in, 140), 37, odd_in, c.format, c.dtype, c.scales),
      b(random_normal(37 * odd_in, 141), 37, odd_in, c.format, c.dtype, c.scales);
  std::vector<DeviceWeight> ta{upload(a.weight())}, tb{upload(b.weight())};
  DeviceWeight *da = device_copy(ta), *db = device_copy(tb);
  const std::vector<int32_t> ids{0, -1, 0};
  int32_t* dids = device_copy(ids);
  float* dx = device_copy(random_normal(3 * odd_in, 142));
  EXPECT_FALSE(linear_mma_takes(ta[0], dx));
  float *y1 = device_poisoned(3 * 37), *y2 = device_poisoned(3 * 37), *w1 = device_poisoned(3 * 37),
        *w2 = device_poisoned(3 * 37);
  linear_pairs_mma_two(da, db, 1, ta[0], dids, 3, 1, dx, y1, y2, nullptr);
  linear_pairs(da, 1, ta[0], dids, 3, 1, dx, w1, nullptr);
  linear_pairs(db, 1, ta[0], dids, 3, 1, dx, w2, nullptr);
  for (const auto& [got, want] : {std::pair{y1, w1}, std::pair{y2, w2}}) {
    const std::vector<float> g = host_copy(got, 3 * 37), w = host_copy(want, 3 * 37);
    EXPECT_TRUE(std::none_of(g.begin(), g.end(), [](float v) { return std::isnan(v); })) << c.name << " (GEMV pairs)";
    EXPECT_EQ(std::memcmp(g.data(), w.data(), g.size() * sizeof(float)), 0) << c.name << " (GEMV pairs)";
  }
  release(ta[0]);
  release(tb[0]);
  for (void* q : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dids), static_cast<void*>(dx),
                  static_cast<void*>(y1), static_cast<void*>(y2), static_cast<void*>(w1), static_cast<void*>(w2)})
    cudaFree(q);
}

}  // namespace
}  // namespace keel::cuda
