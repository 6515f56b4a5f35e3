// What the GPU matrix-kernel tests share (test_gemm_mma_cuda.cpp, test_gemm_fp8_cuda.cpp):
// row views of FP8 weights, and the check of a kernel against its CPU reference over
// token counts that cross its tiles, with every token's row also compared bit for bit
// with a call on that token alone.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/linear.h"
#include "gpu/device_memory.h"
#include "ops/linear.h"

namespace keel::cuda {

// Rows [first, first + count) of an FP8 weight on the device, as the grouped output
// projection views them: the data from that row, scale blocks still counted from the
// stored row 0 (first_row).
inline DeviceWeight fp8_rows(const DeviceWeight& w, int64_t first, int64_t count) {
  DeviceWeight v = w;
  v.out = count;
  v.data = static_cast<const uint8_t*>(w.data) + first * w.in;
  v.first_row = w.first_row + first;
  return v;
}

// Whether the tests run under compute-sanitizer (scripts/gpu-check sets this for its
// memcheck and racecheck stages). There the bit-for-bit calls on one token alone are
// made for each count's first and last token only: the others are the same launch on
// other data, so they find no further hazard, and each costs the sanitizers tens of
// milliseconds (racecheck took about 2 minutes per parametrized GEMM test with all of
// them). Without it, every token is compared.
inline bool sanitized_run() {
  static const bool sanitized = [] {
    const char* v = std::getenv("KEEL_GPU_TESTS_SANITIZED");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return sanitized;
}

// The items of `n` whose bit-for-bit alone call is checked: all, or first and last
// under the sanitizers.
inline bool compared_alone(int64_t i, int64_t n) { return !sanitized_run() || i == 0 || i == n - 1; }

// A kernel under test and what it is held to.
struct GemmCheck {
  double tolerance;  // of each output's scale
  std::vector<float> (*inputs)(int64_t tokens, int64_t in, uint32_t seed);
  void (*reference)(const Weight& w, ConstRows x, Rows y, RowRange range);
  // Each output's scale: Σ_k |x[t, k]·W[first + o, k]| as the kernel sees x.
  std::vector<double> (*scales)(const Weight& w, const std::vector<float>& x, int64_t tokens, int64_t first, int64_t out);
  bool (*takes)(const DeviceWeight& w, const float* x);
  void (*run)(const DeviceWeight& w, const float* x, float* y, int64_t tokens);
};

// Runs `d` (a view of rows [first, first + out) of `host`) over each token count: every
// output within the tolerance of the CPU reference, and every token's row equal, bit
// for bit, to a call with that token alone. Prints the worst ratio seen.
inline void check_against_reference(const GemmCheck& k, const char* name, const Weight& host, const DeviceWeight& d,
                                    int64_t first, uint32_t seed) {
  const int64_t out = d.out, in = d.in;
  double worst = 0;
  float* alone = device_poisoned(out);
  for (const int64_t tokens : {1, 7, 8, 9, 33, 64, 130}) {
    const std::vector<float> x = k.inputs(tokens, in, seed + static_cast<uint32_t>(tokens));
    std::vector<float> want(tokens * out);
    k.reference(host, rows_of(std::span<const float>(x), in), rows_of(std::span<float>(want), out), {first, out});
    const std::vector<double> scale = k.scales(host, x, tokens, first, out);
    float* dx = device_copy(x);
    ASSERT_TRUE(k.takes(d, dx)) << name << " " << out << "x" << in;
    float* dy = device_poisoned(tokens * out);
    k.run(d, dx, dy, tokens);
    const std::vector<float> got = host_copy(dy, tokens * out);
    for (int64_t i = 0; i < tokens * out; ++i) {
      const double err = std::fabs(double{got[i]} - want[i]);
      ASSERT_LE(err, k.tolerance * scale[i]) << name << " " << out << "x" << in << " tokens " << tokens << " token "
                                             << i / out << " row " << i % out << ": got " << got[i] << ", want "
                                             << want[i];
      if (scale[i] > 0) worst = std::max(worst, err / scale[i]);
    }
    for (int64_t t = 0; t < tokens; ++t) {
      if (!compared_alone(t, tokens)) continue;
      ASSERT_EQ(cudaMemset(alone, 0xff, out * sizeof(float)), cudaSuccess);
      k.run(d, dx + t * in, alone, 1);
      const std::vector<float> one = host_copy(alone, out);
      ASSERT_EQ(std::memcmp(one.data(), got.data() + t * out, out * sizeof(float)), 0)
          << name << " " << out << "x" << in << ": token " << t << " of " << tokens
          << " differs from the same token alone";
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  cudaFree(alone);
  std::printf("  %s %lldx%lld (rows from %lld): worst error %.2e of sum |x·w|\n", name, static_cast<long long>(out),
              static_cast<long long>(in), static_cast<long long>(first), worst);
}

}  // namespace keel::cuda
