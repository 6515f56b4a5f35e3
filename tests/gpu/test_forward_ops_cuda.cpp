// The GPU forward pass's small data-movement ops against plain host copies.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cuda/forward_ops.h"
#include "gpu/device_memory.h"
#include "testing.h"

namespace keel::cuda {
namespace {

// Jobs of ragged lengths (one past a block's chunk, one empty, one of a single float)
// into separate places of one poisoned buffer: every job's floats land exactly, and
// nothing between the jobs is written.
TEST(CudaForwardOps, CopyBatchCopiesEveryJobAndNothingElse) {
  const std::vector<int64_t> counts{512, 1, 0, 4097, 9000, 33};
  int64_t total = 0;
  for (int64_t n : counts) total += n + 3;  // 3 floats of gap after each job
  const std::vector<float> source = keel::testing::random_normal(total, 5);
  float* src = device_copy(source);
  float* dst = device_poisoned(total);
  std::vector<CopyJob> jobs;
  int64_t at = 0, longest = 0;
  for (int64_t n : counts) {
    jobs.push_back({dst + at, src + total - at - n, n});  // from the other end of the source
    at += n + 3;
    longest = std::max(longest, n);
  }
  const CopyJob* djobs = device_copy(jobs);
  copy_batch(djobs, static_cast<int64_t>(jobs.size()), longest);
  const std::vector<float> got = host_copy(dst, total);
  at = 0;
  for (int64_t n : counts) {
    EXPECT_EQ(std::memcmp(got.data() + at, source.data() + total - at - n, n * sizeof(float)), 0) << "job of " << n;
    for (int64_t g = 0; g < 3; ++g) EXPECT_TRUE(std::isnan(got[at + n + g])) << "gap after the job of " << n;
    at += n + 3;
  }
  cudaFree(src);
  cudaFree(dst);
  cudaFree(const_cast<CopyJob*>(djobs));
}

// Moves of 16 bytes, of a block's vectors and one more, and past the grid's stride
// (the kernel's loop), from page-locked host memory read through its device address
// and from device memory, into separate places of one poisoned buffer: every byte
// lands, nothing between them is written; addresses or sizes off 16 are refused.
TEST(CudaForwardOps, CopyBytesMovesHostAndDeviceBytesExactly) {
  const std::vector<int64_t> sizes{16, 256 * 16 + 16, 70000 * 16};
  int64_t total = 0;
  for (int64_t n : sizes) total += n / 4 + 4;  // floats; 4 floats of gap after each
  const std::vector<float> source = keel::testing::random_normal(total, 7);
  float* host = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), total * sizeof(float), cudaHostAllocMapped), cudaSuccess);
  std::memcpy(host, source.data(), total * sizeof(float));
  float* host_on_device = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_on_device), host, 0), cudaSuccess);
  float* on_device = device_copy(source);
  for (const float* src : {static_cast<const float*>(host_on_device), static_cast<const float*>(on_device)}) {
    float* dst = device_poisoned(total);
    int64_t at = 0;
    for (int64_t n : sizes) {
      copy_bytes(dst + at, src + at, n);
      at += n / 4 + 4;
    }
    const std::vector<float> got = host_copy(dst, total);
    at = 0;
    for (int64_t n : sizes) {
      EXPECT_EQ(std::memcmp(got.data() + at, source.data() + at, n), 0) << "move of " << n << " bytes";
      for (int64_t g = 0; g < 4; ++g) EXPECT_TRUE(std::isnan(got[at + n / 4 + g])) << "gap after " << n << " bytes";
      at += n / 4 + 4;
    }
    EXPECT_THROW(copy_bytes(dst + 1, src, 16), std::runtime_error);
    EXPECT_THROW(copy_bytes(dst, src, 20), std::runtime_error);
    cudaFree(dst);
  }
  cudaFree(on_device);
  cudaFreeHost(host);
}

// Compressor slots by their definition (dsv4-forward.md §5.6, §5.7), for windows at
// consecutive rows (first_row) and at rows given per window (windows of several
// sequences gathered into one buffer), HCA and CSA, with and without the previous
// series. Exact: the op only moves values and adds one bias.
TEST(CudaForwardOps, CompressorSlotsFollowTheirDefinition) {
  const int ratio = 4, dim = 24;
  const int64_t rows = 40;
  for (const bool overlapping : {false, true}) {
    const int64_t width = overlapping ? 2 * dim : dim;
    const std::vector<float> kv = keel::testing::random_normal(rows * width, 31);
    const std::vector<float> gate = keel::testing::random_normal(rows * width, 32);
    const std::vector<float> ape = keel::testing::random_normal(ratio * width, 33);
    float *dkv = device_copy(kv), *dgate = device_copy(gate), *dape = device_copy(ape);
    for (const bool previous : {false, true}) {
      if (previous && !overlapping) continue;
      const std::vector<int64_t> starts{4, 13, 30, 8};  // ragged, out of order
      for (const bool given : {false, true}) {
        const int64_t first_row = 8, windows = static_cast<int64_t>(starts.size());
        const int slots = previous ? 2 * ratio : ratio;
        const int64_t n = windows * slots * dim;
        float *values = device_poisoned(n), *gates = device_poisoned(n);
        const int64_t* dstarts = given ? device_copy(starts) : nullptr;
        compressor_slots(dkv, dgate, dape, width, dim, ratio, overlapping, first_row, windows, previous, values, gates,
                         nullptr, dstarts);
        const std::vector<float> got_v = host_copy(values, n), got_g = host_copy(gates, n);
        const int half = overlapping ? dim : 0;
        for (int64_t w = 0; w < windows; ++w) {
          const int64_t start = given ? starts[w] : first_row + w * ratio;
          for (int s = 0; s < slots; ++s) {
            const bool before = previous && s < ratio;
            const int j = before ? s : s - (previous ? ratio : 0);
            const int64_t row = before ? start - ratio + j : start + j;
            const int channel0 = before ? 0 : half;
            for (int c = 0; c < dim; ++c) {
              const int64_t at = (w * slots + s) * dim + c;
              ASSERT_EQ(got_v[at], kv[row * width + channel0 + c]) << overlapping << previous << given << " " << at;
              ASSERT_EQ(got_g[at], gate[row * width + channel0 + c] + ape[j * width + channel0 + c]) << at;
            }
          }
        }
        cudaFree(values);
        cudaFree(gates);
        cudaFree(const_cast<int64_t*>(dstarts));
      }
    }
    cudaFree(dkv);
    cudaFree(dgate);
    cudaFree(dape);
  }
}

// Each token's row of e joins every one of its group's rows, and nothing else changes.
TEST(CudaForwardOps, AddToGroupsAddsEachTokensRowToItsGroup) {
  const int64_t rows = 5, width = 301;
  const int group = 4;
  const std::vector<float> y0 = keel::testing::random_normal(rows * group * width, 41);
  const std::vector<float> e = keel::testing::random_normal(rows * width, 42);
  float* y = device_copy(y0);
  float* de = device_copy(e);
  add_to_groups(y, de, rows, group, width);
  const std::vector<float> got = host_copy(y, y0.size());
  for (int64_t t = 0; t < rows; ++t) {
    for (int j = 0; j < group; ++j) {
      for (int64_t c = 0; c < width; ++c) {
        const int64_t at = (t * group + j) * width + c;
        ASSERT_EQ(got[at], y0[at] + e[t * width + c]) << t << " " << j << " " << c;
      }
    }
  }
  cudaFree(y);
  cudaFree(de);
}

}  // namespace
}  // namespace keel::cuda
