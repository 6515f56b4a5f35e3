// Manifold-constrained hyper-connections (mHC, dsv4-forward.md §4): the residual is `hc`
// parallel streams of width D. Around each sublayer a per-token mix collapses the
// streams into the sublayer input (`pre`) and writes the output back (`post`) while
// mixing the streams through a Sinkhorn-projected doubly stochastic matrix (`comb`).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace keel {

struct HyperParams {
  int hc = 0;          // streams
  int64_t dim = 0;     // D
  int sinkhorn_iters = 0;
  float hc_eps = 0.0f;
  float norm_eps = 0.0f;  // rms_norm_eps: the RMS over the flattened streams
};

// One mHC site: fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3].
struct HyperSite {
  std::vector<float> fn, base, scale;
};

// The hc_head collapse before the final norm: fn [hc, hc·D], base [hc], scale [1].
struct HyperHead {
  std::vector<float> fn, base, scale;
};

// Per-token mixing weights of one site.
struct HyperMix {
  std::vector<float> pre;   // [hc]
  std::vector<float> post;  // [hc]
  std::vector<float> comb;  // [hc, hc], row j = from stream j (consumed transposed)
};

// `streams` is one token's [hc, D], stream-major.
HyperMix hyper_mix(const HyperParams& p, const HyperSite& site, std::span<const float> streams);
// out[D] = Σ_j pre_j · streams[j]
void hyper_collapse(const HyperParams& p, std::span<const float> pre, std::span<const float> streams,
                    std::span<float> out);
// streams[k] ← post_k · y + Σ_j comb[j][k] · streams[j]
void hyper_expand(const HyperParams& p, const HyperMix& mix, std::span<const float> y, std::span<float> streams);
// hc_head: out[D] = Σ_j (σ(mix_j · scale + base_j) + hc_eps) · streams[j]
void hyper_head(const HyperParams& p, const HyperHead& head, std::span<const float> streams, std::span<float> out);

// Softmax over each row, + eps, then column-first Sinkhorn normalization with eps in
// every denominator (`iters` column and iters − 1 row passes). `m` is [n, n] logits.
void sinkhorn(std::span<float> m, int n, int iters, float eps);

}  // namespace keel
