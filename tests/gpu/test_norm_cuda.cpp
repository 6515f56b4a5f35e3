// The CUDA RMSNorms against ops/norm.h on random rows (never zeros), at widths below,
// at and across the block's thread count, outputs poisoned with NaN first.
//
// Tolerance 1e-5 relative: both sides compute in f32 and differ only in the order of
// the sum of squares (the GPU's strided partial sums and shuffle tree against the CPU's
// SIMD lanes), a few ULPs of the factor even at 7168 channels; a wrong factor, a wrong
// row or channel, or an unwritten output is off by far more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <vector>

#include "cuda/norm.h"
#include "gpu/device_memory.h"
#include "ops/norm.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

constexpr float kTolerance = 1e-5f;

TEST(CudaNorm, WeightedMatchesCpuReference) {
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{1, 7}, {5, 32}, {3, 250}, {17, 1024}, {4, 4096 + 3},
                                 {2, 7168}}) {
    // Rows of different scales, so a factor taken from the wrong row shows.
    std::vector<float> x = random_normal(rows * dim, 11);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < dim; ++i) x[r * dim + i] *= 0.25f + static_cast<float>(r);
    const std::vector<float> w = random_normal(dim, 12, 0.5f);
    const float eps = 1e-6f;
    std::vector<float> want(x.size());
    for (int64_t r = 0; r < rows; ++r) {
      keel::rms_norm(std::span<const float>(x).subspan(r * dim, dim), w, eps, std::span<float>(want).subspan(r * dim, dim));
    }
    float* dx = device_copy(x);
    float* dw = device_copy(w);
    float* dy = device_poisoned(x.size());
    rms_norm(dx, dw, eps, dy, rows, dim);
    const std::vector<float> got = host_copy(dy, x.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], kTolerance * (1e-3f + std::fabs(want[i]))) << rows << "x" << dim << " at " << i;
    }
    // In place (out aliases x), as the CPU allows.
    rms_norm(dx, dw, eps, dx, rows, dim);
    const std::vector<float> in_place = host_copy(dx, x.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(in_place[i], got[i]) << "in place, at " << i;
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dy);
  }
}

TEST(CudaNorm, UnweightedPerHeadMatchesCpuReference) {
  // q heads: rows = tokens · heads, dim = head_dim (tiny: 32; Flash: 64 heads of 512).
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{3 * 4, 32}, {2 * 64, 512}, {5, 100}}) {
    std::vector<float> x = random_normal(rows * dim, 21, 3.0f);
    std::vector<float> want = x;
    const float eps = 1e-6f;
    for (int64_t r = 0; r < rows; ++r) keel::rms_norm_unweighted(std::span<float>(want).subspan(r * dim, dim), eps);
    float* dx = device_copy(x);
    rms_norm_unweighted(dx, eps, rows, dim);
    const std::vector<float> got = host_copy(dx, x.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], kTolerance * (1e-3f + std::fabs(want[i]))) << rows << "x" << dim << " at " << i;
      ASSERT_NE(got[i], x[i]) << "row not normalized at " << i;
    }
    cudaFree(dx);
  }
}

}  // namespace
}  // namespace keel::cuda
