#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace keel {
namespace {

// As transformers computes them, in f32: base_i = theta^(2i / rd); YaRN blends
// 1 / base_i (extrapolation) with 1 / (factor · base_i) (interpolation) over a ramp.
std::vector<float> frequencies(const RopeConfig& c) {
  const int half = c.rope_dim / 2;
  std::vector<float> base(half);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.rope_dim);
    base[i] = std::pow(static_cast<float>(c.theta), exponent);
  }
  std::vector<float> f(half);
  for (int i = 0; i < half; ++i) f[i] = 1.0f / base[i];
  if (!c.yarn) return f;
  // The channel index where rotations over the original context reach `turns` turns.
  const auto correction = [&](double turns) {
    return c.rope_dim * std::log(c.yarn_original_max_position / (turns * 2 * std::numbers::pi)) /
           (2 * std::log(c.theta));
  };
  const float low = static_cast<float>(std::max(std::floor(correction(c.yarn_beta_fast)), 0.0));
  float high = static_cast<float>(std::min(std::ceil(correction(c.yarn_beta_slow)), c.rope_dim - 1.0));
  if (low == high) high += 0.001f;  // avoid a zero-width ramp
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp((static_cast<float>(i) - low) / (high - low), 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float interpolated = 1.0f / (static_cast<float>(c.yarn_factor) * base[i]);
    f[i] = interpolated * (1.0f - extrapolation) + f[i] * extrapolation;
  }
  return f;
}

}  // namespace

Rope::Rope(const RopeConfig& config) : rope_dim_(config.rope_dim), inv_freq_(frequencies(config)) {}

void Rope::apply(std::span<float> head, int64_t position, bool inverse) const {
  float* x = head.data() + head.size() - rope_dim_;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int i = 0; i < rope_dim_ / 2; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];  // f32, as transformers
    const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s = sign * static_cast<float>(std::sin(static_cast<double>(angle)));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

void Rope::apply_heads(std::span<float> heads, int head_dim, int64_t position, bool inverse) const {
  for (size_t h = 0; h + head_dim <= heads.size(); h += head_dim) {
    apply(heads.subspan(h, head_dim), position, inverse);
  }
}

}  // namespace keel
