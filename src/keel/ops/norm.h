// RMSNorm, weighted and unweighted (dsv4-forward.md §2.1, §2.2), in f32.
#pragma once

#include <cstdint>
#include <span>

namespace keel {

// out = weight ⊙ x · rsqrt(mean(x²) + eps). `out` may alias `x`.
void rms_norm(std::span<const float> x, std::span<const float> weight, float eps, std::span<float> out);

// x ← x · rsqrt(mean(x²) + eps).
void rms_norm_unweighted(std::span<float> x, float eps);

// rsqrt(mean(x²) + eps), the factor both apply.
float rms_factor(std::span<const float> x, float eps);

}  // namespace keel
