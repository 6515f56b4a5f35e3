#include "cuda/norm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_chunks.cuh"

namespace keel::cuda {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kMaxWarps = kMaxThreads / kWarp;

// A thread's first kHeld chunks of x and weight stay in registers between the sum of
// squares and the output, so rows up to kHeld · blockDim.x chunks are read once and the
// weight's loads overlap the reduction. Longer rows read the rest again.
constexpr int kHeld = 2;

// One block per row; thread k takes chunks k, k + blockDim.x, ... and sums their squares
// in that order. blockDim.x depends on dim only (threads_for), so a row's result is the
// same whatever else is in the call. As ops/norm.cpp's rms_factor: 1 / sqrt(Σx² / n +
// eps), f32, IEEE sqrt and division.
template <bool Weighted, int Width>
__global__ void __launch_bounds__(kMaxThreads)
    rms_rows(const float* x, const float* __restrict__ weight, float eps, float* out, int64_t dim) {
  __shared__ float shared[kMaxWarps];
  const int64_t chunks = dim / Width, stride = blockDim.x;
  Chunk<Width> xs[kHeld], ws[kHeld];
  // The weight before the wait: no kernel writes it, and a block started early has it
  // at hand when x is ready.
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    if (const int64_t i = threadIdx.x + h * stride; Weighted && i < chunks) ws[h] = load<Width>(weight, i);
  }
  let_next_start();
  wait_for_inputs();
  const float* xr = x + int64_t{blockIdx.x} * dim;
  float* yr = out + int64_t{blockIdx.x} * dim;
  float sum = 0.0f;
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    if (const int64_t i = threadIdx.x + h * stride; i < chunks) {
      xs[h] = load<Width>(xr, i);
      sum = add_squares(sum, xs[h]);
    }
  }
  for (int64_t i = threadIdx.x + kHeld * stride; i < chunks; i += stride) sum = add_squares(sum, load<Width>(xr, i));
  const float r = 1.0f / sqrtf(warps_sum(sum, shared, static_cast<int>(blockDim.x) / kWarp) / static_cast<float>(dim) + eps);
  // Every read of x above precedes the barrier in warps_sum, and each thread writes only
  // what it read, so out may alias x.
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    if (const int64_t i = threadIdx.x + h * stride; i < chunks) store(yr, i, scaled<Weighted>(xs[h], ws[h], r));
  }
  for (int64_t i = threadIdx.x + kHeld * stride; i < chunks; i += stride) {
    Chunk<Width> w{};
    if constexpr (Weighted) w = load<Width>(weight, i);
    store(yr, i, scaled<Weighted>(load<Width>(xr, i), w, r));
  }
}

// Threads per row, from dim alone (see rms_rows): kHeld chunks each, a multiple of the
// warp, at most kMaxThreads. A 4096 row is 512 threads issuing two float4 loads of x and
// two of weight at once: as many loads in flight as 1024 threads of one chunk, with half
// the warps to reduce.
int threads_for(int64_t chunks) {
  const int64_t threads = (chunks + kHeld - 1) / kHeld;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, (threads + kWarp - 1) / kWarp * kWarp));
}

template <bool Weighted>
void launch(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t dim, void* stream) {
  if (rows <= 0) return;
  if (dim <= 0) throw std::runtime_error("cuda::rms_norm: dim must be positive");
  if (rows > 0x7fffffff) throw std::runtime_error("cuda::rms_norm: too many rows (" + std::to_string(rows) + ")");
  const auto s = static_cast<cudaStream_t>(stream);
  if (float4_rows(dim, {x, out, weight})) {  // weight is null unweighted
    overlapped_launch("rms_norm launch", rms_rows<Weighted, 4>, static_cast<unsigned>(rows), threads_for(dim / 4), 0, s,
                      x, weight, eps, out, dim);
  } else {
    overlapped_launch("rms_norm launch", rms_rows<Weighted, 1>, static_cast<unsigned>(rows), threads_for(dim), 0, s, x,
                      weight, eps, out, dim);
  }
}

}  // namespace

void rms_norm(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t dim, void* stream) {
  launch<true>(x, weight, eps, out, rows, dim, stream);
}

void rms_norm_unweighted(float* x, float eps, int64_t rows, int64_t dim, void* stream) {
  launch<false>(x, nullptr, eps, x, rows, dim, stream);
}

void register_norm(Registry& registry) {
  KernelInfo k{.name = "cuda_rmsnorm",
               .op = Op::norm,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "RMSNorm, one block of up to 1024 threads per row, float4 loads, warp-shuffle reduction"};
  registry.add(std::move(k.with_entry(&rms_norm)));
}

}  // namespace keel::cuda
