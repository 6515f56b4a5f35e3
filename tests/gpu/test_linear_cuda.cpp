// The CUDA matrix kernel against the CPU reference (ops/linear.h's linear_reference,
// f64 sums over the quant/ dequantizers) for every stored format, on random weights
// and inputs, at sizes that cross the row tiles and scale blocks, outputs poisoned.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cuda/linear.h"
#include "gpu/device_memory.h"
#include "model/owned_weight.h"
#include "ops/linear.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

struct Case {
  WeightFormat format;
  DType dtype;
  ScaleFormat scales;
  const char* name;
};

class CudaLinear : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLinear, MatchesCpuReference) {
  const Case& c = GetParam();
  // out: not a multiple of the 32-row tile nor of 128; in: crosses FP8 blocks unevenly.
  for (const auto& [out, in] : {std::pair<int64_t, int64_t>{261, 320}, {1029, 4096 + 128}, {7, 64}}) {
    const OwnedWeight host(random_normal(out * in, 5), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    for (const int64_t tokens : {1, 3}) {
      const std::vector<float> x = random_normal(tokens * in, 6);
      std::vector<float> want(tokens * out);
      keel::linear_reference(host.weight(), keel::rows_of(std::span<const float>(x), in),
                             keel::rows_of(std::span<float>(want), out));
      float* dx = device_copy(x);
      float* dy = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dy), want.size() * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(dy, 0xff, want.size() * sizeof(float)), cudaSuccess);  // NaN poison
      linear(w, dx, dy, tokens);
      std::vector<float> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), dy, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-4f * (1.0f + std::fabs(want[i])))
            << c.name << " " << out << "x" << in << " tokens " << tokens << " at " << i;
      }
      cudaFree(dx);
      cudaFree(dy);
    }
    release(w);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, CudaLinear,
    ::testing::Values(Case{WeightFormat::f32, DType::f32, ScaleFormat::ue8m0, "f32"},
                      Case{WeightFormat::bf16, DType::bf16, ScaleFormat::ue8m0, "bf16"},
                      Case{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::ue8m0, "fp8_ue8m0"},
                      Case{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::f32, "fp8_f32"},
                      Case{WeightFormat::mxfp4, DType::i8, ScaleFormat::ue8m0, "mxfp4"},
                      Case{WeightFormat::nvfp4, DType::u8, ScaleFormat::ue8m0, "nvfp4"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(CudaLinear, RefusesRowsItCannotTile) {
  const OwnedWeight host(random_normal(8 * 24, 1), 8, 24, WeightFormat::fp8_block, DType::f8_e4m3);
  DeviceWeight w = upload(host.weight());
  EXPECT_THROW(linear(w, nullptr, nullptr, 1), std::runtime_error);
  release(w);
}

}  // namespace
}  // namespace keel::cuda
