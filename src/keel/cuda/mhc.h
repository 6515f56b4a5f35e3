// Manifold-constrained hyper-connections on the GPU (dsv4-forward.md §4): the CUDA
// counterpart of ops/hyper.h, tested against it. Per token, the residual is `hc` streams
// of width D ([tokens, hc, D] f32 in device memory, stream-major per token).
#pragma once

#include <cstdint>

#include "ops/hyper.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

constexpr int kMaxHyperStreams = 8;

// Per-token mixing weights of one site, as ops/hyper.cpp's hyper_mix: the RMS over the
// hc·D flattened streams, the fn projection, sigmoids, and the Sinkhorn projection of
// comb with hc_eps in every denominator. fn [(2+hc)·hc, hc·D], base [(2+hc)·hc] and
// scale [3] are in device memory; pre and post are [tokens, hc], comb [tokens, hc, hc]
// (row j = from stream j). `scratch` holds hyper_mix_scratch(p, tokens) floats.
// hc ≤ kMaxHyperStreams. Asynchronous on `stream`.
void hyper_mix(const HyperParams& p, const float* fn, const float* base, const float* scale, const float* streams,
               int64_t tokens, float* pre, float* post, float* comb, float* scratch, void* stream = nullptr);
int64_t hyper_mix_scratch(const HyperParams& p, int64_t tokens);

// out[t] = Σ_j pre[t, j] · streams[t, j]; out is [tokens, D].
void hyper_collapse(const HyperParams& p, const float* pre, const float* streams, int64_t tokens, float* out,
                    void* stream = nullptr);

// streams[t, k] ← post[t, k] · y[t] + Σ_j comb[t, j, k] · streams[t, j], in place; y is
// [tokens, D].
void hyper_expand(const HyperParams& p, const float* post, const float* comb, const float* y, float* streams,
                  int64_t tokens, void* stream = nullptr);

// hc_head, the final collapse, as ops/hyper.cpp's hyper_head: out[t] = Σ_j (σ(mix_j ·
// scale[0] + base[j]) + hc_eps) · streams[t, j] with mix = fn · the RMS-normalized
// flattened streams. fn [hc, hc·D], base [hc] and scale [1] are in device memory; out
// is [tokens, D]; `scratch` holds hyper_head_scratch(p, tokens) floats. hc ≤
// kMaxHyperStreams. Asynchronous on `stream`.
void hyper_head(const HyperParams& p, const float* fn, const float* base, const float* scale, const float* streams,
                int64_t tokens, float* out, float* scratch, void* stream = nullptr);
int64_t hyper_head_scratch(const HyperParams& p, int64_t tokens);

// Adds this family's kernels to the registry (called from cuda/kernels.cu).
void register_mhc(Registry& registry);

}  // namespace keel::cuda
