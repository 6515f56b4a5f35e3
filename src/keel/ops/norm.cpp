#include "ops/norm.h"

#include <cmath>

namespace keel {

float rms_factor(std::span<const float> x, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (size_t i = 0; i < x.size(); ++i) sum += x[i] * x[i];
  return 1.0f / std::sqrt(sum / static_cast<float>(x.size()) + eps);
}

void rms_norm(std::span<const float> x, std::span<const float> weight, float eps, std::span<float> out) {
  const float r = rms_factor(x, eps);
  for (size_t i = 0; i < x.size(); ++i) out[i] = weight[i] * (x[i] * r);
}

void rms_norm_unweighted(std::span<float> x, float eps) {
  const float r = rms_factor(x, eps);
  for (float& v : x) v *= r;
}

}  // namespace keel
