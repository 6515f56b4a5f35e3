#include "cuda/norm.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

constexpr int kMaxWarps = 8;

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 256); every thread
// gets the total. `shared` holds kMaxWarps floats.
__device__ float block_sum(float v, float* shared) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += shared[w];  // the same order in every thread
  return total;
}

// As ops/norm.cpp's rms_factor: 1 / sqrt(Σx² / n + eps), f32, IEEE sqrt and division.
template <bool Weighted>
__global__ void rms_rows(const float* x, const float* __restrict__ weight, float eps, float* out, int64_t dim) {
  __shared__ float shared[kMaxWarps];
  const float* xr = x + int64_t{blockIdx.x} * dim;
  float* yr = out + int64_t{blockIdx.x} * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i] * xr[i];
  const float r = 1.0f / sqrtf(block_sum(sum, shared) / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    if constexpr (Weighted) {
      yr[i] = weight[i] * (xr[i] * r);
    } else {
      yr[i] = xr[i] * r;
    }
  }
}

int threads_for(int64_t dim) { return dim >= 2048 ? 256 : dim >= 256 ? 128 : kWarp; }

template <bool Weighted>
void launch(const float* x, const float* weight, float eps, float* out, int64_t rows, int64_t dim, void* stream) {
  if (rows <= 0) return;
  if (dim <= 0) throw std::runtime_error("cuda::rms_norm: dim must be positive");
  if (rows > 0x7fffffff) throw std::runtime_error("cuda::rms_norm: too many rows (" + std::to_string(rows) + ")");
  rms_rows<Weighted><<<static_cast<unsigned>(rows), threads_for(dim), 0, static_cast<cudaStream_t>(stream)>>>(
      x, weight, eps, out, dim);
  check(cudaGetLastError(), "rms_norm launch");
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
               .summary = "RMSNorm over many rows, one block per row, warp-shuffle reduction"};
  registry.add(std::move(k.with_entry(&rms_norm)));
}

}  // namespace keel::cuda
