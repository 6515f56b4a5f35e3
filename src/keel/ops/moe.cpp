#include "ops/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace keel {

void score_router(std::span<float> logits, ScoringFunc func) {
  for (float& x : logits) {
    switch (func) {
      case ScoringFunc::sqrtsoftplus:  // PyTorch softplus: x itself past threshold 20
        x = std::sqrt(x > 20.0f ? x : std::log1p(std::exp(x)));
        break;
      case ScoringFunc::sigmoid: x = 1.0f / (1.0f + std::exp(-x)); break;
    }
  }
}

Routing route(std::span<const float> scores, std::span<const float> bias, std::span<const int32_t> hashed, int k,
              float scaling) {
  Routing r;
  if (!hashed.empty()) {
    r.experts.assign(hashed.begin(), hashed.end());
  } else {
    std::vector<int32_t> order(scores.size());
    std::iota(order.begin(), order.end(), 0);
    const auto biased = [&](int32_t e) { return scores[e] + (bias.empty() ? 0.0f : bias[e]); };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return biased(a) > biased(b) || (biased(a) == biased(b) && a < b);
    });
    r.experts.assign(order.begin(), order.begin() + k);
  }
  float sum = 0.0f;
  for (int32_t e : r.experts) sum += scores[e];
  for (int32_t e : r.experts) r.weights.push_back(scores[e] / (sum + 1e-20f) * scaling);
  return r;
}

void clamped_swiglu(std::span<float> gate, std::span<const float> up, float limit) {
  for (size_t i = 0; i < gate.size(); ++i) {
    const float g = std::min(gate[i], limit);
    const float u = std::clamp(up[i], -limit, limit);
    gate[i] = g / (1.0f + std::exp(-g)) * u;
  }
}

}  // namespace keel
