#include "cuda/moe.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a million threads fill any GPU; past that each loops

// The CPU's expression in its order; std::min and std::clamp spelled out so that a NaN
// gate or up goes through as it does there (fminf would drop it).
__global__ void swiglu(float* gate, const float* __restrict__ up, int64_t count, float limit) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = limit < gate[i] ? limit : gate[i];
    const float u = up[i] < -limit ? -limit : limit < up[i] ? limit : up[i];
    gate[i] = g / (1.0f + expf(-g)) * u;
  }
}

// One thread per (token, column); the pairs summed in slot order, then the shared expert.
__global__ void combine(const float* __restrict__ y, const float* __restrict__ weights, int64_t tokens, int k,
                        int64_t dim, const float* __restrict__ shared, float* __restrict__ out) {
  const int64_t n = tokens * dim;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / dim, d = i % dim;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += weights[t * k + j] * y[(t * k + j) * dim + d];
    out[i] = shared ? sum + shared[i] : sum;
  }
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks)); }

}  // namespace

void clamped_swiglu(float* gate, const float* up, int64_t count, float limit, void* stream) {
  if (count <= 0) return;
  swiglu<<<blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(gate, up, count, limit);
  check(cudaGetLastError(), "clamped_swiglu launch");
}

void combine_pairs(const float* y, const float* weights, int64_t tokens, int k, int64_t dim, const float* shared,
                   float* out, void* stream) {
  if (tokens <= 0 || dim <= 0) return;
  combine<<<blocks_for(tokens * dim), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(y, weights, tokens, k, dim,
                                                                                       shared, out);
  check(cudaGetLastError(), "combine_pairs launch");
}

}  // namespace keel::cuda
