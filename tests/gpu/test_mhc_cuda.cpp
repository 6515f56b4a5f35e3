// The CUDA mHC kernels against ops/hyper.h and ops/norm.h: a site's input (the per-token
// mix: RMS, fn projection, sigmoids, Sinkhorn with hc_eps in every denominator; the
// collapse; the sublayer's RMSNorm) and the expand at hc 4 (the lane-per-entry Sinkhorn)
// and hc 2, 3, 8 (the serial one), D from one partial slice of the mix's dots to 71
// slices, 1 to 33 tokens; hc_head likewise; outputs poisoned.
//
// Tolerances (both sides f32): the mix's logits are dot products over hc·D (up to 57344)
// terms whose summation orders differ (the CPU's SIMD lanes against the GPU's 32 lanes
// and shuffle tree), ~1e-6 of a logit of size ~1; the sigmoids and the 20 Sinkhorn
// passes (each a normalization, which does not amplify it) carry that through, so pre,
// post and comb are held to 2e-5 · (1 + |want|); x carries pre's error through the
// collapse and norm (check_site_in_and_expand). The expand adds hc products in the CPU's
// order (FMA contraction aside): 1e-6 · (1 + |want|). A wrong stream, row or
// transposed comb is off by ~0.1 or more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/mhc.h"
#include "gpu/device_memory.h"
#include "ops/hyper.h"
#include "ops/norm.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

void expect_close(const std::vector<float>& got, const std::vector<float>& want, float tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance * (1.0f + std::fabs(want[i]))) << what << " at " << i;
  }
}

// One case of the site input (mix, collapse, norm) and the expand against the CPU: hc
// streams of width dim, `tokens` tokens, `iters` Sinkhorn iterations.
void check_site_in_and_expand(int hc, int64_t dim, int64_t tokens, int iters) {
  const HyperParams p{.hc = hc, .dim = dim, .sinkhorn_iters = iters, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
  const int rows = (2 + hc) * hc;
  const int64_t width = hc * dim;
  const std::string at = "hc " + std::to_string(hc) + " D " + std::to_string(dim) + " tokens " +
                         std::to_string(tokens) + " iters " + std::to_string(iters);
  const auto seed = static_cast<uint32_t>(hc * 1000 + dim + tokens);
  // fn scaled so the logits are of size ~1, as in a trained model (not saturated).
  HyperSite site{random_normal(rows * width, seed + 1, 1.0f / std::sqrt(static_cast<float>(width))),
                 random_normal(rows, seed + 2, 0.5f), {0.7f, 1.3f, 2.0f}};
  const std::vector<float> norm = random_normal(dim, seed + 5);
  std::vector<float> streams = random_normal(tokens * width, seed + 3, 2.0f);
  const std::vector<float> y = random_normal(tokens * dim, seed + 4);

  std::vector<float> want_pre, want_post, want_comb, want_x(tokens * dim), want_streams = streams;
  std::vector<float> x_tolerance(tokens * dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const std::span<const float> st(streams.data() + t * width, width);
    const HyperMix mix = keel::hyper_mix(p, site, st);
    want_pre.insert(want_pre.end(), mix.pre.begin(), mix.pre.end());
    want_post.insert(want_post.end(), mix.post.begin(), mix.post.end());
    want_comb.insert(want_comb.end(), mix.comb.begin(), mix.comb.end());
    const std::span<float> xt = std::span<float>(want_x).subspan(t * dim, dim);
    keel::hyper_collapse(p, mix.pre, st, xt);
    const float r = rms_factor(xt, p.norm_eps);
    keel::rms_norm(xt, norm, p.norm_eps, xt);
    // pre is held to 2e-5 · (1 + pre) ≤ 2e-5 · 2 below; through the collapse that is
    // 2e-5 · 2 · Σ_j |s_j| per channel, times the norm's |w| · r (r's own error, a sum of
    // squares in another order, is ~1e-6).
    for (int64_t d = 0; d < dim; ++d) {
      float magnitude = 0.0f;
      for (int j = 0; j < hc; ++j) magnitude += std::fabs(st[j * dim + d]);
      x_tolerance[t * dim + d] = 2e-5f * (1.0f + std::fabs(xt[d]) + 2.0f * std::fabs(norm[d]) * r * magnitude);
    }
    keel::hyper_expand(p, mix, std::span<const float>(y).subspan(t * dim, dim),
                       std::span<float>(want_streams).subspan(t * width, width));
  }

  DeviceScope scope;
  const SiteParams dsite{scope.copy(site.fn), scope.copy(site.base), scope.copy(site.scale), scope.copy(norm)};
  float* dstreams = scope.copy(streams);
  float* dy = scope.copy(y);
  float* dscratch = scope.copy(std::vector<float>(hyper_in_scratch(p, tokens), std::nanf("")));
  unsigned* darrivals = scope.copy(std::vector<unsigned>(tokens, 0u));
  // Twice, outputs poisoned each time: the counters the first call leaves must serve the
  // second.
  for (int call = 0; call < 2; ++call) {
    const SiteMix out{scope.copy(std::vector<float>(tokens * hc, std::nanf(""))),
                      scope.copy(std::vector<float>(tokens * hc, std::nanf(""))),
                      scope.copy(std::vector<float>(tokens * hc * hc, std::nanf(""))),
                      scope.copy(std::vector<float>(tokens * dim, std::nanf("")))};
    hyper_in(p, dsite, dstreams, tokens, out, dscratch, darrivals);
    const std::string call_at = at + " call " + std::to_string(call);
    expect_close(host_copy(out.pre, want_pre.size()), want_pre, 2e-5f, call_at + " pre");
    expect_close(host_copy(out.post, want_post.size()), want_post, 2e-5f, call_at + " post");
    const std::vector<float> comb = host_copy(out.comb, want_comb.size());
    expect_close(comb, want_comb, 2e-5f, call_at + " comb");
    // Doubly stochastic to within the iterations' convergence (not a comparison with the
    // CPU: a check that the projection ran). The last pass is a column pass.
    for (int64_t t = 0; t < tokens; ++t) {
      for (int k = 0; k < hc; ++k) {
        float column = 0.0f;
        for (int j = 0; j < hc; ++j) column += comb[t * hc * hc + j * hc + k];
        ASSERT_NEAR(column, 1.0f, 1e-3f) << call_at << " token " << t << " column " << k;
      }
    }
    const std::vector<float> x = host_copy(out.x, want_x.size());
    for (size_t i = 0; i < want_x.size(); ++i) {
      ASSERT_NEAR(x[i], want_x[i], x_tolerance[i]) << call_at << " x at " << i;
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(host_copy(darrivals, tokens), std::vector<unsigned>(tokens, 0u)) << at << ": counters left zero";

  // The expand from the CPU's own weights, so it is checked on its own.
  hyper_expand(p, scope.copy(want_post), scope.copy(want_comb), dy, dstreams, tokens);
  expect_close(host_copy(dstreams, want_streams.size()), want_streams, 1e-6f, at + " expand");
}

// hc 4 (every DeepSeek-V4) takes the lane-per-entry Sinkhorn, hc 2 (the flashlike test
// model), 3 and 8 (kMaxHyperStreams) the serial one. D 64 is one partial slice of the
// mix's dots, 1000 a few (hc · 1000 ends mid-slice), 4096 and 7168 (Flash and Pro) 8 to
// 56, across the 16-slice batches the sums load in; 9000 holds more chunks of x per
// collapsing thread than its registers keep (float4 rows), 77 and 2051 are rows of
// single floats, 2051 past the registers too; 33 tokens is more than a warp.
TEST(CudaMhc, SiteInAndExpandMatchCpuReference) {
  for (const int hc : {4, 2, 3, 8}) {
    for (const int64_t dim : {int64_t{64}, int64_t{77}, int64_t{1000}, int64_t{2051}, int64_t{4096}, int64_t{7168},
                              int64_t{9000}}) {
      for (const int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{33}}) {
        check_site_in_and_expand(hc, dim, tokens, 20);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The expand of the MoE's pairs against the CPU's weighted sum (in the documented
// order: pair by pair, then the shared row) and its hyper_expand. Each y carries the
// rounding of k products and adds (FMA contraction aside, up to an ULP of Σ|w · pair|
// each), times post (< 2): held to 1e-6 · (1 + |want| + 2 · k · Σ_i |w_i · pair_i|).
// k 6 (Flash) and 1; with and without the shared expert; D 4096 and 77.
TEST(CudaMhc, ExpandPairsMatchesCombineThenExpand) {
  for (const auto& [k, dim, with_shared] : {std::tuple{6, int64_t{4096}, true}, {6, int64_t{77}, false},
                                            {1, int64_t{77}, true}}) {
    const HyperParams p{.hc = 4, .dim = dim, .sinkhorn_iters = 20, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
    const int hc = p.hc;
    const int64_t tokens = 3, width = hc * dim;
    const std::vector<float> pairs = random_normal(tokens * k * dim, 61), weights = random_normal(tokens * k, 62, 0.3f);
    const std::vector<float> shared = random_normal(tokens * dim, 63);
    const std::vector<float> post = random_normal(tokens * hc, 64), comb = random_normal(tokens * hc * hc, 65, 0.5f);
    const std::vector<float> streams = random_normal(tokens * width, 66, 2.0f);
    std::vector<float> want = streams, tolerance(tokens * width);
    for (int64_t t = 0; t < tokens; ++t) {
      const HyperMix mix{{}, {post.begin() + t * hc, post.begin() + (t + 1) * hc},
                         {comb.begin() + t * hc * hc, comb.begin() + (t + 1) * hc * hc}};
      std::vector<float> y(dim), magnitude(dim);
      for (int64_t d = 0; d < dim; ++d) {
        float sum = 0.0f;
        for (int i = 0; i < k; ++i) {
          sum += weights[t * k + i] * pairs[(t * k + i) * dim + d];
          magnitude[d] += std::fabs(weights[t * k + i] * pairs[(t * k + i) * dim + d]);
        }
        y[d] = with_shared ? sum + shared[t * dim + d] : sum;
      }
      keel::hyper_expand(p, mix, y, std::span<float>(want).subspan(t * width, width));
      for (int64_t i = 0; i < width; ++i) {
        const int64_t at = t * width + i;
        tolerance[at] = 1e-6f * (1.0f + std::fabs(want[at]) + 2.0f * k * magnitude[i % dim]);
      }
    }
    DeviceScope scope;
    float* dstreams = scope.copy(streams);
    hyper_expand_pairs(p, scope.copy(post), scope.copy(comb), scope.copy(pairs), scope.copy(weights), k,
                       with_shared ? scope.copy(shared) : nullptr, dstreams, tokens);
    const std::vector<float> got = host_copy(dstreams, want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], tolerance[i]) << "k " << k << " D " << dim << " at " << i;
    }
  }
}

// One Sinkhorn iteration is the softmax and a single column pass; two adds a row pass.
TEST(CudaMhc, MixWithFewSinkhornIterations) {
  for (const int hc : {4, 3}) {
    for (const int iters : {1, 2}) {
      check_site_in_and_expand(hc, 64, 3, iters);
      if (HasFatalFailure()) return;
    }
  }
}

// hc_head: the mix's pre (held to 2e-5 above) times the streams, so each output is within
// 2e-5 · Σ_j |streams[t, j, d]| plus the collapse's own rounding: 2e-5 · (1 + Σ_j |s_j|).
// D 77 and 4100 are multiples of neither the warp nor the block (160 threads at hc 4);
// hc 4 at D 9000 is 36 slices, past two 16-slice batches. A wrong stream, or a missing
// RMS (the streams' RMS is 2), is off by ~0.1 or more.
TEST(CudaMhc, HeadMatchesCpuReference) {
  for (const auto& [hc_streams, dim] : {std::pair<int, int64_t>{4, 77}, {4, 4100}, {2, 4100}, {4, 9000}}) {
    const HyperParams p{.hc = hc_streams, .dim = dim, .sinkhorn_iters = 20, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
    const int hc = p.hc;
    const int64_t width = hc * dim, tokens = 5;
    HyperHead head{random_normal(hc * width, 95, 1.0f / std::sqrt(static_cast<float>(width))),
                   random_normal(hc, 96, 0.5f), {0.8f}};
    const std::vector<float> streams = random_normal(tokens * width, 97, 2.0f);
    std::vector<float> want(tokens * dim);
    for (int64_t t = 0; t < tokens; ++t) {
      keel::hyper_head(p, head, std::span<const float>(streams).subspan(t * width, width),
                       std::span<float>(want).subspan(t * dim, dim));
    }

    float* dfn = device_copy(head.fn);
    float* dbase = device_copy(head.base);
    float* dscale = device_copy(head.scale);
    float* dstreams = device_copy(streams);
    float* dout = device_poisoned(tokens * dim);
    float* dscratch = device_poisoned(hyper_head_scratch(p, tokens));
    hyper_head(p, dfn, dbase, dscale, dstreams, tokens, dout, dscratch);
    const std::vector<float> got = host_copy(dout, want.size());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        float magnitude = 0.0f;
        for (int j = 0; j < hc; ++j) magnitude += std::fabs(streams[t * width + j * dim + d]);
        ASSERT_NEAR(got[t * dim + d], want[t * dim + d], 2e-5f * (1.0f + magnitude))
            << "hc " << hc << " D " << dim << " token " << t << " channel " << d;
      }
    }
    for (float* q : {dfn, dbase, dscale, dstreams, dout, dscratch}) cudaFree(q);
  }
}

TEST(CudaMhc, RefusesTooManyStreams) {
  const HyperParams p{.hc = kMaxHyperStreams + 1, .dim = 8, .sinkhorn_iters = 1, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
  EXPECT_THROW(hyper_in(p, {}, nullptr, 1, {}, nullptr, nullptr), std::runtime_error);
  EXPECT_THROW(hyper_head(p, nullptr, nullptr, nullptr, nullptr, 1, nullptr, nullptr), std::runtime_error);
}

}  // namespace
}  // namespace keel::cuda
