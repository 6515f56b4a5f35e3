// Pieces the row-wise kernels share (cuda/norm.cu, cuda/mhc.cu, cuda/rope.cu): a row read
// in chunks of Width consecutive floats (float4 loads when 4), and a sum over the warps
// of a block. For .cu files only.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "cuda/check.cuh"

namespace keel::cuda {

// Whether rows of `dim` floats at these pointers read in float4 chunks: dim a multiple
// of 4 and every pointer 16-byte aligned (null ones, absent arguments, count as
// aligned). A row's offset r · dim keeps its base's alignment then, so a row alone takes
// the same path as in a batch.
inline bool float4_rows(int64_t dim, std::initializer_list<const void*> pointers) {
  if (dim % 4 != 0) return false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Width consecutive floats of a row: float4 loads when Width is 4 (the caller checks
// 16-byte alignment), single floats when 1.
template <int Width>
struct Chunk {
  float v[Width];
};

template <int Width>
__device__ __forceinline__ Chunk<Width> load(const float* p, int64_t i) {
  if constexpr (Width == 4) {
    const float4 q = reinterpret_cast<const float4*>(p)[i];
    return {{q.x, q.y, q.z, q.w}};
  } else {
    return {{p[i]}};
  }
}

template <int Width>
__device__ __forceinline__ void store(float* p, int64_t i, const Chunk<Width>& c) {
  if constexpr (Width == 4) {
    reinterpret_cast<float4*>(p)[i] = make_float4(c.v[0], c.v[1], c.v[2], c.v[3]);
  } else {
    p[i] = c.v[0];
  }
}

template <int Width>
__device__ __forceinline__ float add_squares(float sum, const Chunk<Width>& c) {
#pragma unroll
  for (int k = 0; k < Width; ++k) sum += c.v[k] * c.v[k];
  return sum;
}

// x ⊙ w · r (Weighted) or x · r, channel by channel, as ops/norm.cpp rounds it.
template <bool Weighted, int Width>
__device__ __forceinline__ Chunk<Width> scaled(Chunk<Width> x, const Chunk<Width>& w, float r) {
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    if constexpr (Weighted) {
      x.v[k] = w.v[k] * (x.v[k] * r);
    } else {
      x.v[k] *= r;
    }
  }
  return x;
}

// Sum of `v` over the first `warps` warps of the block, which all call it and no other
// thread does; every caller gets the total, added in warp order. `shared` holds `warps`
// floats. The whole block (warps == blockDim.x / 32) meets at barrier 0 (__syncthreads);
// fewer warps at named barrier 1.
__device__ __forceinline__ float warps_sum(float v, float* shared, int warps) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = v;
  if (warps * kWarp == static_cast<int>(blockDim.x)) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 1, %0;" ::"r"(warps * kWarp) : "memory");
  }
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += shared[w];  // the same order in every thread
  return total;
}

}  // namespace keel::cuda
