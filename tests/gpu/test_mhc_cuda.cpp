// The CUDA mHC kernels against ops/hyper.h: the per-token mix (RMS, fn projection,
// sigmoids, Sinkhorn with hc_eps in every denominator), collapse and expand at hc 4 (the
// lane-per-entry Sinkhorn) and hc 2, 3, 8 (the serial one), D from one partial slice of
// the mix's dots to 56 slices, 1 to 33 tokens; hc_head likewise; outputs poisoned.
//
// Tolerances (both sides f32): the mix's logits are dot products over hc·D (up to 57344)
// terms whose summation orders differ (the CPU's SIMD lanes against the GPU's 32 lanes
// and shuffle tree), ~1e-6 of a logit of size ~1; the sigmoids and the 20 Sinkhorn
// passes (each a normalization, which does not amplify it) carry that through, so pre,
// post and comb are held to 2e-5 · (1 + |want|). Collapse and expand add hc products in
// the CPU's order (FMA contraction aside): 1e-6 · (1 + |want|). A wrong stream, row or
// transposed comb is off by ~0.1 or more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/mhc.h"
#include "gpu/device_memory.h"
#include "ops/hyper.h"
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

// One case of the mix, collapse and expand against the CPU: hc streams of width dim,
// `tokens` tokens, `iters` Sinkhorn iterations.
void check_mix_collapse_expand(int hc, int64_t dim, int64_t tokens, int iters) {
  const HyperParams p{.hc = hc, .dim = dim, .sinkhorn_iters = iters, .hc_eps = 1e-6f, .norm_eps = 1e-6f};
  const int rows = (2 + hc) * hc;
  const int64_t width = hc * dim;
  const std::string at = "hc " + std::to_string(hc) + " D " + std::to_string(dim) + " tokens " +
                         std::to_string(tokens) + " iters " + std::to_string(iters);
  const auto seed = static_cast<uint32_t>(hc * 1000 + dim + tokens);
  // fn scaled so the logits are of size ~1, as in a trained model (not saturated).
  HyperSite site{random_normal(rows * width, seed + 1, 1.0f / std::sqrt(static_cast<float>(width))),
                 random_normal(rows, seed + 2, 0.5f), {0.7f, 1.3f, 2.0f}};
  std::vector<float> streams = random_normal(tokens * width, seed + 3, 2.0f);
  const std::vector<float> y = random_normal(tokens * dim, seed + 4);

  std::vector<float> want_pre, want_post, want_comb, want_out(tokens * dim), want_streams = streams;
  for (int64_t t = 0; t < tokens; ++t) {
    const std::span<const float> st(streams.data() + t * width, width);
    const HyperMix mix = keel::hyper_mix(p, site, st);
    want_pre.insert(want_pre.end(), mix.pre.begin(), mix.pre.end());
    want_post.insert(want_post.end(), mix.post.begin(), mix.post.end());
    want_comb.insert(want_comb.end(), mix.comb.begin(), mix.comb.end());
    keel::hyper_collapse(p, mix.pre, st, std::span<float>(want_out).subspan(t * dim, dim));
    keel::hyper_expand(p, mix, std::span<const float>(y).subspan(t * dim, dim),
                       std::span<float>(want_streams).subspan(t * width, width));
  }

  float* dfn = device_copy(site.fn);
  float* dbase = device_copy(site.base);
  float* dscale = device_copy(site.scale);
  float* dstreams = device_copy(streams);
  float* dy = device_copy(y);
  float* dpre = device_poisoned(tokens * hc);
  float* dpost = device_poisoned(tokens * hc);
  float* dcomb = device_poisoned(tokens * hc * hc);
  float* dscratch = device_poisoned(hyper_mix_scratch(p, tokens));
  float* dout = device_poisoned(tokens * dim);

  hyper_mix(p, dfn, dbase, dscale, dstreams, tokens, dpre, dpost, dcomb, dscratch);
  expect_close(host_copy(dpre, want_pre.size()), want_pre, 2e-5f, at + " pre");
  expect_close(host_copy(dpost, want_post.size()), want_post, 2e-5f, at + " post");
  const std::vector<float> comb = host_copy(dcomb, want_comb.size());
  expect_close(comb, want_comb, 2e-5f, at + " comb");
  // Doubly stochastic to within the iterations' convergence (not a comparison with the
  // CPU: a check that the projection ran). The last pass is a column pass.
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < hc; ++k) {
      float column = 0.0f;
      for (int j = 0; j < hc; ++j) column += comb[t * hc * hc + j * hc + k];
      ASSERT_NEAR(column, 1.0f, 1e-3f) << at << " token " << t << " column " << k;
    }
  }

  // Collapse and expand from the CPU's own weights, so each is checked on its own.
  float* dwant_pre = device_copy(want_pre);
  float* dwant_post = device_copy(want_post);
  float* dwant_comb = device_copy(want_comb);
  hyper_collapse(p, dwant_pre, dstreams, tokens, dout);
  expect_close(host_copy(dout, want_out.size()), want_out, 1e-6f, at + " collapse");
  hyper_expand(p, dwant_post, dwant_comb, dy, dstreams, tokens);
  expect_close(host_copy(dstreams, want_streams.size()), want_streams, 1e-6f, at + " expand");

  for (float* q : {dfn, dbase, dscale, dstreams, dy, dpre, dpost, dcomb, dscratch, dout, dwant_pre, dwant_post,
                   dwant_comb})
    cudaFree(q);
}

// hc 4 (every DeepSeek-V4) takes the lane-per-entry Sinkhorn, hc 2 (the flashlike test
// model), 3 and 8 (kMaxHyperStreams) the serial one. D 64 is one partial slice of the
// mix's dots, 1000 a few (hc · 1000 ends mid-slice), 4096 and 7168 (Flash and Pro)
// 8 to 56, across the 16-slice batches the sums load in; 33 tokens is more than a warp.
TEST(CudaMhc, MixCollapseExpandMatchCpuReference) {
  for (const int hc : {4, 2, 3, 8}) {
    for (const int64_t dim : {int64_t{64}, int64_t{1000}, int64_t{4096}, int64_t{7168}}) {
      for (const int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{33}}) {
        check_mix_collapse_expand(hc, dim, tokens, 20);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// One Sinkhorn iteration is the softmax and a single column pass; two adds a row pass.
TEST(CudaMhc, MixWithFewSinkhornIterations) {
  for (const int hc : {4, 3}) {
    for (const int iters : {1, 2}) {
      check_mix_collapse_expand(hc, 64, 3, iters);
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
  EXPECT_THROW(hyper_collapse(p, nullptr, nullptr, 1, nullptr), std::runtime_error);
  EXPECT_THROW(hyper_head(p, nullptr, nullptr, nullptr, nullptr, 1, nullptr, nullptr), std::runtime_error);
}

}  // namespace
}  // namespace keel::cuda
