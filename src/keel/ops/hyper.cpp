#include "ops/hyper.h"

#include <algorithm>
#include <cmath>

#include "ops/norm.h"

namespace keel {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// mix = (v · rsqrt(mean(v²) + eps)) · fnᵀ over the flattened streams v.
std::vector<float> mix_logits(const HyperParams& p, const std::vector<float>& fn, std::span<const float> streams) {
  const int64_t width = p.hc * p.dim;
  const int64_t rows = static_cast<int64_t>(fn.size()) / width;
  const float r = rms_factor(streams, p.norm_eps);
  std::vector<float> mix(rows);
  for (int64_t m = 0; m < rows; ++m) {
    const float* w = fn.data() + m * width;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) sum += streams[i] * r * w[i];
    mix[m] = sum;
  }
  return mix;
}

void normalize_rows(std::span<float> m, int n, float eps) {
  for (int i = 0; i < n; ++i) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) sum += m[i * n + j];
    for (int j = 0; j < n; ++j) m[i * n + j] /= sum + eps;
  }
}

void normalize_columns(std::span<float> m, int n, float eps) {
  for (int j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += m[i * n + j];
    for (int i = 0; i < n; ++i) m[i * n + j] /= sum + eps;
  }
}

}  // namespace

void sinkhorn(std::span<float> m, int n, int iters, float eps) {
  for (int i = 0; i < n; ++i) {
    float* row = m.data() + i * n;
    const float top = *std::max_element(row, row + n);
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) sum += row[j] = std::exp(row[j] - top);
    for (int j = 0; j < n; ++j) row[j] = row[j] / sum + eps;
  }
  normalize_columns(m, n, eps);
  for (int it = 1; it < iters; ++it) {
    normalize_rows(m, n, eps);
    normalize_columns(m, n, eps);
  }
}

HyperMix hyper_mix(const HyperParams& p, const HyperSite& site, std::span<const float> streams) {
  const int hc = p.hc;
  const std::vector<float> mix = mix_logits(p, site.fn, streams);
  HyperMix out{std::vector<float>(hc), std::vector<float>(hc), std::vector<float>(hc * hc)};
  for (int j = 0; j < hc; ++j) {
    out.pre[j] = sigmoid(mix[j] * site.scale[0] + site.base[j]) + p.hc_eps;
    out.post[j] = 2.0f * sigmoid(mix[hc + j] * site.scale[1] + site.base[hc + j]);
  }
  for (int i = 0; i < hc * hc; ++i) out.comb[i] = mix[2 * hc + i] * site.scale[2] + site.base[2 * hc + i];
  sinkhorn(out.comb, hc, p.sinkhorn_iters, p.hc_eps);
  return out;
}

void hyper_collapse(const HyperParams& p, std::span<const float> pre, std::span<const float> streams,
                    std::span<float> out) {
  std::fill(out.begin(), out.end(), 0.0f);
  for (int j = 0; j < p.hc; ++j) {
    const float* s = streams.data() + j * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) out[d] += pre[j] * s[d];
  }
}

void hyper_expand(const HyperParams& p, const HyperMix& mix, std::span<const float> y, std::span<float> streams) {
  const int hc = p.hc;
  const std::vector<float> old(streams.begin(), streams.end());
  for (int k = 0; k < hc; ++k) {
    float* s = streams.data() + k * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) {
      float sum = 0.0f;
      for (int j = 0; j < hc; ++j) sum += mix.comb[j * hc + k] * old[j * p.dim + d];
      s[d] = mix.post[k] * y[d] + sum;
    }
  }
}

void hyper_head(const HyperParams& p, const HyperHead& head, std::span<const float> streams, std::span<float> out) {
  const std::vector<float> mix = mix_logits(p, head.fn, streams);
  std::vector<float> pre(p.hc);
  for (int j = 0; j < p.hc; ++j) pre[j] = sigmoid(mix[j] * head.scale[0] + head.base[j]) + p.hc_eps;
  hyper_collapse(p, pre, streams, out);
}

}  // namespace keel
