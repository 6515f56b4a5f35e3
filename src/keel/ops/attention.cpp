#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace keel {
namespace {

float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

void attend(std::span<const float> q, int heads, int head_dim, std::span<const float* const> keys,
            std::span<const float> sinks, float scale, std::span<float> out) {
  std::vector<float> p(keys.size());
  for (int h = 0; h < heads; ++h) {
    const float* qh = q.data() + h * head_dim;
    float top = sinks[h];
    for (size_t j = 0; j < keys.size(); ++j) top = std::max(top, p[j] = dot(qh, keys[j], head_dim) * scale);
    float sum = std::exp(sinks[h] - top);
    for (float& v : p) sum += v = std::exp(v - top);
    float* oh = out.data() + h * head_dim;
    std::fill(oh, oh + head_dim, 0.0f);
    for (size_t j = 0; j < keys.size(); ++j) {
      const float w = p[j] / sum;
      for (int d = 0; d < head_dim; ++d) oh[d] += w * keys[j][d];
    }
  }
}

std::vector<int64_t> indexer_select(std::span<const float> q, std::span<const float> weights, int heads,
                                    int key_dim, std::span<const float* const> keys, int k) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(key_dim));
  const auto visible = static_cast<int64_t>(keys.size());
  std::vector<float> score(visible);
  for (int64_t w = 0; w < visible; ++w) {
    const float* key = keys[w];
    float sum = 0.0f;
    for (int h = 0; h < heads; ++h) {
      sum += weights[h] * std::max(dot(q.data() + h * key_dim, key, key_dim), 0.0f) * scale;
    }
    score[w] = sum;
  }
  std::vector<int64_t> order(visible);
  std::iota(order.begin(), order.end(), 0);
  const int64_t take = std::min<int64_t>(k, visible);
  std::partial_sort(order.begin(), order.begin() + take, order.end(),
                    [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
  order.resize(take);
  return order;
}

}  // namespace keel
