// Manifold-constrained hyper-connections on the GPU (dsv4-forward.md §4): the CUDA
// counterpart of ops/hyper.h, tested against it. Per token, the residual is `hc` streams
// of width D ([tokens, hc, D] f32 in device memory, stream-major per token).
#pragma once

#include <cstdint>

#include "ops/hyper.h"
#include "plan/kernel_registry.h"

namespace keel::cuda {

constexpr int kMaxHyperStreams = 8;

// One site's parameters in device memory: fn [(2+hc)·hc, hc·D], base [(2+hc)·hc] and
// scale [3] of the mix, and `norm` [D], the weight of its sublayer's input RMSNorm.
struct SiteParams {
  const float *fn, *base, *scale, *norm;
};

// What hyper_in writes, in device memory: pre and post [tokens, hc], comb [tokens, hc,
// hc] (row j = from stream j), x [tokens, D].
struct SiteMix {
  float *pre, *post, *comb, *x;
};

// An mHC site's input to its sublayer, in one launch (the CPU's hyper_mix, hyper_collapse
// and the sublayer's RMSNorm): per token the mixing weights (the RMS over the hc·D
// flattened streams, the fn projection, sigmoids, and the Sinkhorn projection of comb
// with hc_eps in every denominator), then x = RMSNorm(Σ_j pre[j] · streams[j]; norm)
// with p.norm_eps. `scratch` holds hyper_in_scratch(p, tokens) floats; `arrivals` holds
// `tokens` counters, zero before the first call, which each call leaves zero again (the
// kernel counts its blocks in them). hc ≤ kMaxHyperStreams. Asynchronous on `stream`.
void hyper_in(const HyperParams& p, const SiteParams& site, const float* streams, int64_t tokens, const SiteMix& out,
              float* scratch, unsigned* arrivals, void* stream = nullptr);
int64_t hyper_in_scratch(const HyperParams& p, int64_t tokens);

// streams[t, k] ← post[t, k] · y[t] + Σ_j comb[t, j, k] · streams[t, j], in place; y is
// [tokens, D].
void hyper_expand(const HyperParams& p, const float* post, const float* comb, const float* y, float* streams,
                  int64_t tokens, void* stream = nullptr);

// hyper_expand with y the MoE's output, formed on the way as cuda::combine_pairs does:
// y[t] = Σ_{i<k} weights[t·k + i] · pairs[t·k + i] (+ shared[t] when shared is not null),
// pairs [tokens·k, D] and shared [tokens, D] in device memory (the same bits as
// combine_pairs, then hyper_expand).
void hyper_expand_pairs(const HyperParams& p, const float* post, const float* comb, const float* pairs,
                        const float* weights, int k, const float* shared, float* streams, int64_t tokens,
                        void* stream = nullptr);

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
