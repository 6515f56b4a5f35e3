// The CUDA slot pooling against ops/compressor.h's pool_slots on random windows
// (gates of mixed scales so the softmax is neither flat nor one-hot), outputs poisoned.
//
// Tolerance 2e-6 · (1 + |want|): the kernel sums in the CPU's order; only expf (≤ 2 ULPs)
// against std::exp and FMA contraction differ, a few ULPs of a convex combination.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <tuple>
#include <vector>

#include "cuda/compressor.h"
#include "gpu/device_memory.h"
#include "ops/compressor.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

TEST(CudaCompressor, PoolSlotsMatchesCpuReference) {
  // CSA-like (8 slots), HCA-like (128 slots), one slot; widths crossing the block.
  for (const auto& [entries, slots, dim] : {std::tuple<int64_t, int, int>{3, 8, 512}, {2, 128, 300}, {5, 1, 33}}) {
    const std::vector<float> values = random_normal(entries * slots * dim, 101);
    const std::vector<float> gates = random_normal(entries * slots * dim, 102, 3.0f);
    std::vector<float> want(entries * dim);
    for (int64_t e = 0; e < entries; ++e) {
      const size_t window = size_t(slots) * dim;
      keel::pool_slots(std::span<const float>(values).subspan(e * window, window),
                       std::span<const float>(gates).subspan(e * window, window), slots, dim,
                       std::span<float>(want).subspan(e * dim, dim));
    }
    float* dv = device_copy(values);
    float* dg = device_copy(gates);
    float* dout = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dout), want.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(dout, 0xff, want.size() * sizeof(float)), cudaSuccess);  // NaN poison
    pool_slots(dv, dg, entries, slots, dim, dout);
    std::vector<float> got(want.size());
    ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 2e-6f * (1.0f + std::fabs(want[i]))) << slots << " slots x " << dim << " at " << i;
    }
    cudaFree(dv);
    cudaFree(dg);
    cudaFree(dout);
  }
}

}  // namespace
}  // namespace keel::cuda
