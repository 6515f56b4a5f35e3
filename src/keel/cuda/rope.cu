#include "cuda/rope.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

// One thread per rotated pair: index = ((token · heads) + head) · half + i.
__global__ void rotate(const float* __restrict__ inv_freq, float* x, int64_t pairs, int half, int head_dim,
                       int heads, const int64_t* __restrict__ positions, float sign) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= pairs) return;
  const int i = static_cast<int>(n % half);
  const int64_t row = n / half;  // token · heads + head
  const int64_t token = row / heads;
  const float angle = static_cast<float>(positions[token]) * inv_freq[i];  // f32, as the CPU
  float s, c;
  sincosf(angle, &s, &c);
  s *= sign;
  float* p = x + row * head_dim + (head_dim - 2 * half) + 2 * i;
  const float a = p[0], b = p[1];
  p[0] = a * c - b * s;
  p[1] = a * s + b * c;
}

}  // namespace

DeviceRope upload(const Rope& rope) {
  DeviceRope d;
  d.rope_dim = rope.rope_dim();
  const size_t bytes = rope.inv_freq().size() * sizeof(float);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes > 0 ? bytes : sizeof(float)), "cudaMalloc");
  if (bytes > 0) check(cudaMemcpy(p, rope.inv_freq().data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  d.inv_freq = static_cast<const float*>(p);
  return d;
}

void release(DeviceRope& rope) {
  cudaFree(const_cast<float*>(rope.inv_freq));
  rope = {};
}

void rope(const DeviceRope& r, float* x, int64_t tokens, int heads, int head_dim, const int64_t* positions,
          bool inverse, void* stream) {
  if (r.rope_dim % 2 != 0 || r.rope_dim > head_dim) {
    throw std::runtime_error("cuda::rope: rope_dim " + std::to_string(r.rope_dim) + " does not fit head_dim " +
                             std::to_string(head_dim) + " in pairs");
  }
  const int half = r.rope_dim / 2;
  const int64_t pairs = tokens * heads * half;
  if (pairs <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) throw std::runtime_error("cuda::rope: too many rows");
  rotate<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      r.inv_freq, x, pairs, half, head_dim, heads, positions, inverse ? -1.0f : 1.0f);
  check(cudaGetLastError(), "rope launch");
}

void register_rope(Registry&) {}

}  // namespace keel::cuda
