// The CUDA RMSNorms against ops/norm.h on random rows (never zeros), at widths below,
// at and across the block's thread count and its float4 chunks, outputs poisoned with
// NaN first; and a row's result bit-identical whatever else is in the call.
//
// Tolerance 1e-5 relative: both sides compute in f32 and differ only in the order of
// the sum of squares (the GPU's strided partial sums and shuffle tree against the CPU's
// SIMD lanes), a few ULPs of the factor even at 7168 channels; a wrong factor, a wrong
// row or channel, or an unwritten output is off by far more.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
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

// Every combination of few and many rows with widths that are float4 chunks (64, 4096,
// 7168: one chunk per thread, and two) or not (100 = 4 · 25 is; 513 is not), weighted
// and in place unweighted.
TEST(CudaNorm, RowsAndWidthsMatchCpuReference) {
  for (const int64_t rows : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{130}}) {
    for (const int64_t dim : {int64_t{64}, int64_t{100}, int64_t{4096}, int64_t{7168}, int64_t{513}}) {
      const std::string at = std::to_string(rows) + "x" + std::to_string(dim);
      std::vector<float> x = random_normal(rows * dim, static_cast<uint32_t>(31 + rows + dim));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < dim; ++i) x[r * dim + i] *= 0.25f + static_cast<float>(r % 7);
      const std::vector<float> w = random_normal(dim, 32, 0.5f);
      const float eps = 1e-6f;
      std::vector<float> want(x.size()), want_unweighted = x;
      for (int64_t r = 0; r < rows; ++r) {
        keel::rms_norm(std::span<const float>(x).subspan(r * dim, dim), w, eps,
                       std::span<float>(want).subspan(r * dim, dim));
        keel::rms_norm_unweighted(std::span<float>(want_unweighted).subspan(r * dim, dim), eps);
      }
      float* dx = device_copy(x);
      float* dw = device_copy(w);
      float* dy = device_poisoned(x.size());
      rms_norm(dx, dw, eps, dy, rows, dim);
      const std::vector<float> got = host_copy(dy, x.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], kTolerance * (1e-3f + std::fabs(want[i]))) << at << " at " << i;
      }
      rms_norm_unweighted(dx, eps, rows, dim);
      const std::vector<float> got_unweighted = host_copy(dx, x.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got_unweighted[i], want_unweighted[i], kTolerance * (1e-3f + std::fabs(want_unweighted[i])))
            << at << " unweighted, at " << i;
      }
      cudaFree(dx);
      cudaFree(dw);
      cudaFree(dy);
    }
  }
}

// Batched decode relies on a row's output being the same bits whether it is normalized
// alone or with other rows; at widths of float4 chunks and not, and from a buffer that
// is not 16-byte aligned (offset by one float: the scalar path), weighted and in place
// unweighted.
TEST(CudaNorm, RowAloneIsBitIdenticalToRowInBatch) {
  constexpr int64_t kRows = 5;
  for (const int64_t dim : {int64_t{64}, int64_t{100}, int64_t{4096}, int64_t{7168}, int64_t{513}}) {
    for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
      const std::string at = "D " + std::to_string(dim) + " offset " + std::to_string(offset);
      const size_t n = kRows * dim;
      std::vector<float> x = random_normal(offset + n, static_cast<uint32_t>(41 + dim));
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t i = 0; i < dim; ++i) x[offset + r * dim + i] *= 0.25f + static_cast<float>(r);
      const std::vector<float> w = random_normal(dim, 42, 0.5f);
      const float eps = 1e-6f;
      float* const x_base = device_copy(x);
      float* const batch_base = device_poisoned(offset + n);
      float* const alone_base = device_poisoned(offset + n);
      float* const dw = device_copy(w);
      float* const dx = x_base + offset;
      float* const dbatch = batch_base + offset;
      float* const dalone = alone_base + offset;

      rms_norm(dx, dw, eps, dbatch, kRows, dim);
      for (int64_t r = 0; r < kRows; ++r) rms_norm(dx + r * dim, dw, eps, dalone + r * dim, 1, dim);
      const std::vector<float> batch = host_copy(dbatch, n), alone = host_copy(dalone, n);
      for (int64_t r = 0; r < kRows; ++r) {
        EXPECT_EQ(std::memcmp(batch.data() + r * dim, alone.data() + r * dim, dim * sizeof(float)), 0)
            << at << " row " << r;
        // The batch is also right: equal and wrong would pass the comparison above.
        std::vector<float> want(dim);
        keel::rms_norm(std::span<const float>(x).subspan(offset + r * dim, dim), w, eps, want);
        for (int64_t i = 0; i < dim; ++i) {
          ASSERT_NEAR(batch[r * dim + i], want[i], kTolerance * (1e-3f + std::fabs(want[i])))
              << at << " row " << r << " at " << i;
        }
      }

      // Unweighted, in place: the input copied into both buffers first.
      ASSERT_EQ(cudaMemcpy(dbatch, dx, n * sizeof(float), cudaMemcpyDeviceToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dalone, dx, n * sizeof(float), cudaMemcpyDeviceToDevice), cudaSuccess);
      rms_norm_unweighted(dbatch, eps, kRows, dim);
      for (int64_t r = 0; r < kRows; ++r) rms_norm_unweighted(dalone + r * dim, eps, 1, dim);
      const std::vector<float> batch_unweighted = host_copy(dbatch, n), alone_unweighted = host_copy(dalone, n);
      for (int64_t r = 0; r < kRows; ++r) {
        EXPECT_EQ(std::memcmp(batch_unweighted.data() + r * dim, alone_unweighted.data() + r * dim,
                              dim * sizeof(float)),
                  0)
            << at << " unweighted row " << r;
      }
      for (float* q : {x_base, batch_base, alone_base, dw}) cudaFree(q);
    }
  }
}

}  // namespace
}  // namespace keel::cuda
