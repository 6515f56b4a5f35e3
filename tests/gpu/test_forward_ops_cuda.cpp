// The GPU forward pass's small data-movement ops against plain host copies.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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

}  // namespace
}  // namespace keel::cuda
