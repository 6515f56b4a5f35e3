// The sampler's random numbers: a counter-based stream, so a draw depends only on
// (seed, draw, token) and not on the order tokens are visited in, and the same bits on
// the host and on a GPU. Every operation here is exactly rounded (integer hashing,
// IEEE division, explicit fmaf), so both compute the same float: the CPU sampler is
// the reference the CUDA one is tested against token for token.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/host_device.h"

namespace keel {

// SplitMix64's finalizer: a bijection on 64 bits that mixes every input bit.
KEEL_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ln(x) for a positive normal float from IEEE operations only (no libm, whose last bit
// differs between the host and CUDA): x = m·2^e with m in [√½, √2), and
// ln m = 2·atanh(s), s = (m − 1)/(m + 1), |s| < 0.172, by its series to s^11 (the next
// term is below 2^-33 of the result).
KEEL_HOST_DEVICE inline float exact_log(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
  bits = (bits & 0x7fffffu) | 0x3f800000u;
  float m;
  memcpy(&m, &bits, 4);
  if (m > 1.41421356f) {
    m = m * 0.5f;
    ++e;
  }
  const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  float p = 1.0f / 11.0f;
  p = fmaf(p, s2, 1.0f / 9.0f);
  p = fmaf(p, s2, 1.0f / 7.0f);
  p = fmaf(p, s2, 1.0f / 5.0f);
  p = fmaf(p, s2, 1.0f / 3.0f);
  p = fmaf(p, s2, 1.0f);
  const float two_s = 2.0f * s;
  return fmaf(static_cast<float>(e), 0.693147180559945f, two_s * p);
}

// Standard Gumbel noise −ln(−ln U) for `token` in draw `draw` of the stream `seed`;
// U = (2k + 1)·2^-24 for 23 hashed bits k: never 0 or 1, exact in a float.
KEEL_HOST_DEVICE inline float gumbel_noise(uint64_t seed, uint64_t draw, int32_t token) {
  const uint64_t h = mix64(seed ^ mix64(draw * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(static_cast<uint32_t>(token))));
  const auto k = static_cast<uint32_t>(h >> 41);
  const float u = static_cast<float>(2u * k + 1u) * (1.0f / 16777216.0f);
  return -exact_log(-exact_log(u));
}

}  // namespace keel
