#include "cuda/rope.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/norm.h"
#include "cuda/row_chunks.cuh"

namespace keel::cuda {
namespace {

// (a, b) rotated by the angle float(position) · inv_freq (by its negative with sign -1).
__device__ __forceinline__ void rotate_pair(float& a, float& b, int64_t position, float inv_freq, float sign) {
  const float angle = static_cast<float>(position) * inv_freq;  // f32, as the CPU
  float s, c;
  sincosf(angle, &s, &c);
  s *= sign;
  const float x = a, y = b;
  a = x * c - y * s;
  b = x * s + y * c;
}

// One thread per rotated pair: index = ((token · heads) + head) · half + i.
__global__ void rotate(const float* __restrict__ inv_freq, float* x, int64_t pairs, int half, int head_dim,
                       int heads, const int64_t* __restrict__ positions, float sign) {
  wait_for_inputs();
  let_next_start();
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= pairs) return;
  const int i = static_cast<int>(n % half);
  const int64_t row = n / half;  // token · heads + head
  const int64_t token = row / heads;
  float* p = x + row * head_dim + (head_dim - 2 * half) + 2 * i;
  rotate_pair(p[0], p[1], positions[token], inv_freq[i], sign);
}

// One block per row (token · heads + head) of head_dim floats, a float4 chunk per thread
// (threads past the row hold zeros): the row's RMSNorm (by weight when Weighted), then
// the rotation of each pair (2i, 2i+1) from rope_start on, the pair inside the thread's
// chunk (rope_start even).
template <bool Weighted>
__global__ void __launch_bounds__(1024)
    norm_rotate(const float* __restrict__ inv_freq, float* x, const float* __restrict__ weight, float eps,
                int head_dim, int heads, int rope_start, const int64_t* __restrict__ positions) {
  __shared__ float partial[32];
  wait_for_inputs();
  let_next_start();
  const int64_t row = blockIdx.x, token = row / heads;
  float* xr = x + row * head_dim;
  const int chunk = threadIdx.x, first = 4 * chunk;
  const bool inside = first < head_dim;
  Chunk<4> v{}, w{};
  if (inside) {
    v = load<4>(xr, chunk);
    if constexpr (Weighted) w = load<4>(weight, chunk);
  }
  const float squares = warps_sum(add_squares(0.0f, v), partial, static_cast<int>(blockDim.x) / kWarp);
  if (!inside) return;
  v = scaled<Weighted>(v, w, 1.0f / sqrtf(squares / static_cast<float>(head_dim) + eps));
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (const int c = first + 2 * p; c >= rope_start) {
      rotate_pair(v.v[2 * p], v.v[2 * p + 1], positions[token], inv_freq[(c - rope_start) / 2], 1.0f);
    }
  }
  store(xr, chunk, v);
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
  overlapped_launch("rope launch", rotate, static_cast<unsigned>(blocks), kThreads, 0,
                    static_cast<cudaStream_t>(stream), r.inv_freq, x, pairs, half, head_dim, heads, positions,
                    inverse ? -1.0f : 1.0f);
}

void norm_rope(const DeviceRope& r, float* x, int64_t tokens, int heads, int head_dim, const float* weight, float eps,
               const int64_t* positions, void* stream) {
  if (r.rope_dim % 2 != 0 || r.rope_dim > head_dim) {
    throw std::runtime_error("cuda::norm_rope: rope_dim " + std::to_string(r.rope_dim) + " does not fit head_dim " +
                             std::to_string(head_dim) + " in pairs");
  }
  const int64_t rows = tokens * heads;
  if (rows <= 0) return;
  const bool one_launch = head_dim <= 4 * 1024 && float4_rows(head_dim, {x, weight});  // weight may be null
  if (!one_launch) {  // rows of single floats, or longer than a block: the two kernels
    if (weight) {
      rms_norm(x, weight, eps, x, rows, head_dim, stream);
    } else {
      rms_norm_unweighted(x, eps, rows, head_dim, stream);
    }
    rope(r, x, tokens, heads, head_dim, positions, false, stream);
    return;
  }
  if (rows > 0x7fffffff) throw std::runtime_error("cuda::norm_rope: too many rows");
  const int threads = (head_dim / 4 + kWarp - 1) / kWarp * kWarp;
  const auto kernel = weight ? norm_rotate<true> : norm_rotate<false>;
  overlapped_launch("norm_rope launch", kernel, static_cast<unsigned>(rows), threads, 0,
                    static_cast<cudaStream_t>(stream), r.inv_freq, x, weight, eps, head_dim, heads,
                    head_dim - r.rope_dim, positions);
}

void register_rope(Registry&) {}

}  // namespace keel::cuda
