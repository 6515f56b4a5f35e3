// Staging: after a flush, every address stage() returned holds its values, whichever
// way the flush moved the chunk (the copy kernel reading page-locked memory, or DMA past
// kKernelMoveMax bytes), across chunks, across flushes, and once reset() reuses them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "cuda/staging.h"
#include "gpu/device_memory.h"

namespace keel::cuda {
namespace {

// Never zero, and different for every seed.
std::vector<int32_t> random_ints(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = static_cast<int32_t>(rng() | 1u);
  return v;
}

struct Staged {
  std::vector<int32_t> values;
  const int32_t* at;
};

// Stages spans of the given lengths (int32 values), in order.
std::vector<Staged> stage_all(Staging& stage, std::initializer_list<size_t> lengths, uint32_t seed) {
  std::vector<Staged> out;
  for (const size_t n : lengths) {
    out.push_back({random_ints(n, seed++), nullptr});
    out.back().at = stage.stage(std::span<const int32_t>(out.back().values));
  }
  return out;
}

void expect_on_device(const std::vector<Staged>& spans, const char* what) {
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(host_copy(spans[i].at, spans[i].values.size()), spans[i].values) << what << ", span " << i;
  }
}

TEST(CudaStaging, FlushMovesEverySpanByKernelOrDma) {
  constexpr size_t kOverKernel = Staging::kKernelMoveMax / sizeof(int32_t) + 1000;  // one chunk's flush by DMA
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Staging stage;
  EXPECT_EQ(stage.stage(std::span<const int32_t>()), nullptr);
  stage.flush(stream);  // nothing staged: nothing to move

  // Small spans in the first chunk, by the kernel.
  const auto first = stage_all(stage, {3, 1000, 64}, 1);
  stage.flush(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_on_device(first, "first flush");

  // A span too large for the first chunk's room gets a chunk of its own, moved by DMA;
  // the small one after it does not fit there and opens a third chunk (the kernel).
  const auto second = stage_all(stage, {kOverKernel, 5}, 10);
  stage.flush(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_on_device(second, "second flush");
  expect_on_device(first, "first flush, after the second");

  // After reset() the chunks take new values: a span a little smaller than the first
  // large one skips the first chunk for the large one's, and a small span fills that up
  // (two spans in one DMA); the next flush's spans go to the third chunk (the kernel).
  stage.reset();
  const auto third = stage_all(stage, {kOverKernel - 50, 5}, 20);
  stage.flush(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_on_device(third, "after reset");
  const auto fourth = stage_all(stage, {100, 3000}, 30);
  stage.flush(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_on_device(fourth, "after reset, the next flush");
  expect_on_device(third, "after reset, after the next flush");
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace keel::cuda
