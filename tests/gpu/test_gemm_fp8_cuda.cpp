// The W8A8 kernel (cuda/gemm_fp8.h) against its CPU reference (ops/linear.h's
// linear_w8a8_reference: the same activation quantization, then f64 sums of the exact
// FP8 products): its activation quantizer bit for bit against quant/'s
// quantize_fp8_activations; the GEMM within a bound at sizes crossing its row tiles,
// token groups, passes, k shares and FP8 scale blocks, outputs poisoned; every token's
// row bit for bit what a call with that token alone gives; what it does not take, handed
// to linear_mma unchanged. Runs where this build registered the kernel for the GPU.
//
// Tolerance: the products of two FP8 values are exact, and so are the scales (powers of
// two, or the weight's f32 scale times one). What rounds is each MMA's sum of its 32
// products, which the PTX ISA leaves unspecified below f32: Hopper's FP8 tensor cores
// keep about 14 bits when aligning the products (DeepSeek-V3 report, §3.3.2), so one MMA
// may be off by about 2^-13 of the magnitude of its terms, and the f32 additions after it
// add far less. The bound checked is 2^-12 · Σ_k |x̂_k·w_k| per output (x̂ the quantized
// activations); the worst ratio seen is printed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemm_fp8.h"
#include "cuda/gemm_mma.h"
#include "gpu/device_memory.h"
#include "gpu/gemm_check.h"
#include "gpu/weight_cases.h"
#include "model/owned_weight.h"
#include "ops/linear.h"
#include "plan/kernel_registry.h"
#include "quant/fp8_block.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

constexpr double kTolerance = 0x1p-12;

// Skips unless this build registered cuda_w8a8_gemm for GPU 0's architecture.
bool w8a8_runs_here() {
  const std::vector<DeviceInfo> found = devices();
  if (found.empty()) return false;
  const KernelInfo* k = Registry::builtin().find(Op::dense_gemm, "cuda_w8a8_gemm");
  const std::optional<Arch> arch = arch_of_capability(found[0].major, found[0].minor);
  return k && arch && k->archs.has(*arch);
}
#define SKIP_UNLESS_W8A8() \
  if (!w8a8_runs_here()) GTEST_SKIP() << "this build has no FP8 MMA code for this GPU (or no GPU)"

// x with rows of very different sizes: the amax floor (1e-4) and e4m3 subnormals in the
// small ones, saturation-adjacent values in the large.
std::vector<float> activations(int64_t tokens, int64_t in, uint32_t seed) {
  std::vector<float> x = random_normal(tokens * in, seed);
  const float row_scale[] = {1.0f, 3e-6f, 250.0f, 0.01f, 7.0f};
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < in; ++k) x[t * in + k] *= row_scale[t % 5];
  }
  return x;
}

TEST(CudaW8a8, QuantizerMatchesTheCpuBitForBit) {
  SKIP_UNLESS_W8A8();
  for (const int64_t in : {128, 1152}) {
    for (const int64_t tokens : {1, 5, 33}) {
      const std::vector<float> x = activations(tokens, in, static_cast<uint32_t>(in + tokens));
      const int64_t groups = in / 128;
      std::vector<uint8_t> want_codes(tokens * in);
      std::vector<float> want_scales(tokens * groups);
      quantize_fp8_activations(x, tokens, in, 128, want_codes, want_scales);
      float* dx = device_copy(x);
      uint8_t* codes = device_poisoned<uint8_t>(tokens * in);
      float* scales = device_poisoned(tokens * groups);
      quantize_activations_fp8(dx, tokens, in, codes, scales);
      const std::vector<uint8_t> got_codes = host_copy(codes, tokens * in);
      const std::vector<float> got_scales = host_copy(scales, tokens * groups);
      EXPECT_EQ(std::memcmp(got_scales.data(), want_scales.data(), want_scales.size() * sizeof(float)), 0)
          << in << " wide, " << tokens << " tokens: scales differ";
      for (int64_t i = 0; i < tokens * in; ++i) {
        ASSERT_EQ(got_codes[i], want_codes[i]) << in << " wide, " << tokens << " tokens: code " << i << " of x "
                                               << x[i];
      }
      for (void* p : {static_cast<void*>(dx), static_cast<void*>(codes), static_cast<void*>(scales)}) cudaFree(p);
    }
  }
}

// Σ_k |x̂[t, k]·W[first + o, k]| with x̂ the quantized activations: each output's scale.
std::vector<double> magnitudes(const Weight& w, const std::vector<float>& x, int64_t tokens, int64_t first,
                               int64_t out) {
  const int64_t in = in_features(w), groups = in / 128;
  std::vector<uint8_t> codes(tokens * in);
  std::vector<float> scales(tokens * groups), row(in);
  quantize_fp8_activations(x, tokens, in, 128, codes, scales);
  std::vector<double> m(tokens * out);
  for (int64_t o = 0; o < out; ++o) {
    keel::decode_row(w, first + o, row);
    for (int64_t t = 0; t < tokens; ++t) {
      double s = 0;
      for (int64_t k = 0; k < in; ++k) {
        s += std::fabs(double{e4m3_to_f32(codes[t * in + k])} * scales[t * groups + k / 128] * row[k]);
      }
      m[t * out + o] = s;
    }
  }
  return m;
}

const GemmCheck kW8a8{kTolerance,
                      &activations,
                      &keel::linear_w8a8_reference,
                      &magnitudes,
                      &linear_w8a8_takes,
                      [](const DeviceWeight& w, const float* x, float* y, int64_t tokens) { linear_w8a8(w, x, y, tokens); }};

// out: no multiple of a warp's 32 rows nor of a block's; in: 1 to 32 scale blocks, k
// split across 1 to 8 warps in equal and unequal shares; ue8m0 and f32 weight scales.
TEST(CudaW8a8, MatchesTheReferenceAndOneTokenCalls) {
  SKIP_UNLESS_W8A8();
  for (const WeightCase& c : {kFp8Ue8m0, kFp8F32}) {
    for (const auto& [out, in] : {std::pair<int64_t, int64_t>{261, 1152}, {77, 384}, {45, 128}, {100, 4096}}) {
      const OwnedWeight host(random_normal(out * in, 5), out, in, c.format, c.dtype, c.scales);
      DeviceWeight w = upload(host.weight());
      check_against_reference(kW8a8, c.name, host.weight(), w, 0, 20);
      release(w);
    }
  }
}

// A row view from row 100: warp tiles straddle the stored 128-row scale blocks.
TEST(CudaW8a8, RowViewsUseTheStoredScaleBlocks) {
  SKIP_UNLESS_W8A8();
  const OwnedWeight host(random_normal(300 * 1152, 9), 300, 1152, kFp8Ue8m0.format, kFp8Ue8m0.dtype, kFp8Ue8m0.scales);
  DeviceWeight w = upload(host.weight());
  check_against_reference(kW8a8, "fp8 rows 100..176", host.weight(), fp8_rows(w, 100, 77), 100, 30);
  release(w);
}

// Not FP8 or not whole 128-k blocks: linear_mma's result, bit for bit.
TEST(CudaW8a8, OtherWeightsGoToLinearMma) {
  SKIP_UNLESS_W8A8();
  for (const auto& [c, in] : {std::pair<WeightCase, int64_t>{kBf16, 256}, {kMxfp4, 512}, {kFp8Ue8m0, 320}}) {
    const int64_t out = 70;
    const OwnedWeight host(random_normal(out * in, 3), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    const std::vector<float> x = random_normal(9 * in, 4);
    float* dx = device_copy(x);
    EXPECT_FALSE(linear_w8a8_takes(w, dx)) << c.name << " " << out << "x" << in;
    float* mine = device_poisoned(9 * out);
    float* theirs = device_poisoned(9 * out);
    linear_w8a8(w, dx, mine, 9);
    linear_mma(w, dx, theirs, 9);
    const std::vector<float> a = host_copy(mine, 9 * out), b = host_copy(theirs, 9 * out);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << c.name << " " << out << "x" << in;
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(mine), static_cast<void*>(theirs)}) cudaFree(p);
    release(w);
  }
}

}  // namespace
}  // namespace keel::cuda
