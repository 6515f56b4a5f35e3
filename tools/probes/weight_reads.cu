// Probe: what one kernel reading a weight can reach, by access pattern. Loads only, no
// math: a plain grid-stride stream, the one-token tile's pattern (a warp's 32 rows, 64
// bytes a row a step, D steps in flight, with and without the 256-byte L2 fetch hint)
// and the same bytes contiguous per warp, at the k splits mma_k_split could choose.
// Each kernel reads the next of 16 copies, so nothing is found in L2.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o weight_reads weight_reads.cu
//   ./weight_reads          (docs/perf.md has its figures on one H200)
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#include "check.cuh"

__device__ __forceinline__ uint4 ldw(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ldw_plain(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Row layout: warp = (row group of 32 rows, share of k). Lane g,t: rows g, g+8, g+16, g+24 at byte 16t of each 64-B step.
// D: steps in flight (register ring).
template <int D, bool kHint>
__global__ void __launch_bounds__(256) rows_kernel(const uint8_t* w, int64_t row_bytes, int split, uint32_t* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t gw = blockIdx.x * 8 + warp;
  const int64_t row0 = gw / split * 32, share = gw % split;
  const int64_t bytes_per_share = row_bytes / split;
  const int steps = bytes_per_share / 64;
  const uint8_t* p[4];
  for (int i = 0; i < 4; ++i) p[i] = w + (row0 + g + 8 * i) * row_bytes + share * bytes_per_share + 16 * t;
  uint4 ring[D][4];
  uint32_t acc = 0;
#pragma unroll
  for (int d = 0; d < D; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) ring[d][i] = kHint ? ldw(p[i] + 64 * min(d, steps - 1)) : ldw_plain(p[i] + 64 * min(d, steps - 1));
  for (int s = 0; s < steps; s += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
#pragma unroll
      for (int i = 0; i < 4; ++i) { acc ^= ring[d][i].x ^ ring[d][i].y ^ ring[d][i].z ^ ring[d][i].w; }
      const int n = min(s + D + d, steps - 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) ring[d][i] = kHint ? ldw(p[i] + 64 * n) : ldw_plain(p[i] + 64 * n);
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// Tiled layout: each warp's share is contiguous; a step is 4 loads of 512 contiguous bytes.
template <int D>
__global__ void __launch_bounds__(256) tiled_kernel(const uint8_t* w, int64_t share_bytes, uint32_t* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t gw = blockIdx.x * 8 + warp;
  const uint8_t* base = w + gw * share_bytes + 16 * lane;
  const int steps = share_bytes / 2048;
  uint4 ring[D][4];
  uint32_t acc = 0;
#pragma unroll
  for (int d = 0; d < D; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) ring[d][i] = ldw_plain(base + 2048 * min(d, steps - 1) + 512 * i);
  for (int s = 0; s < steps; s += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
#pragma unroll
      for (int i = 0; i < 4; ++i) { acc ^= ring[d][i].x ^ ring[d][i].y ^ ring[d][i].z ^ ring[d][i].w; }
      const int n = min(s + D + d, steps - 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) ring[d][i] = ldw_plain(base + 2048 * n + 512 * i);
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

__global__ void stream_kernel(const uint4* w, int64_t n, uint32_t* out) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint4 v = w[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

int main() {
  const int kCopies = 16;
  struct Shape { const char* name; int64_t rows, row_bytes; } shapes[] = {{"wo_b 4096x8192", 4096, 8192}, {"wq_b 32768x1024", 32768, 1024}, {"wq_a 1024x4096", 1024, 4096}};
  uint32_t* out; CK(cudaMalloc(&out, 4));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (auto& s : shapes) {
    const int64_t bytes = s.rows * s.row_bytes;
    uint8_t* buf; CK(cudaMalloc(&buf, bytes * kCopies)); CK(cudaMemset(buf, 1, bytes * kCopies));
    auto time = [&](auto launch) {
      for (int c = 0; c < kCopies; ++c) launch(buf + c * bytes);
      CK(cudaDeviceSynchronize());
      cudaEventRecord(e0);
      const int reps = 4;
      for (int r = 0; r < reps; ++r) for (int c = 0; c < kCopies; ++c) launch(buf + c * bytes);
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      return ms * 1e3 / (reps * kCopies);
    };
    printf("%s, %.1f MiB\n", s.name, bytes / 1048576.0);
    for (int blocks : {264, 1056, 2112}) {
      float us = time([&](const uint8_t* w) { stream_kernel<<<blocks, 256>>>((const uint4*)w, bytes / 16, out); });
      printf("  stream %5d blocks            %7.2f us %6.0f GB/s\n", blocks, us, bytes / us / 1e3);
    }
    for (int split : {2, 4, 8, 16, 32, 64}) {
      if (s.row_bytes / split < 64) continue;
      const int64_t warps = s.rows / 32 * split; const int blocks = warps / 8;
      if (blocks < 1) continue;
      float r1 = time([&](const uint8_t* w) { rows_kernel<1, true><<<blocks, 256>>>(w, s.row_bytes, split, out); });
      float r1p = time([&](const uint8_t* w) { rows_kernel<1, false><<<blocks, 256>>>(w, s.row_bytes, split, out); });
      float r2 = time([&](const uint8_t* w) { rows_kernel<2, true><<<blocks, 256>>>(w, s.row_bytes, split, out); });
      float r4 = time([&](const uint8_t* w) { rows_kernel<4, true><<<blocks, 256>>>(w, s.row_bytes, split, out); });
      const int64_t share = bytes / warps;
      float t1 = -1, t2 = -1, t4 = -1;
      if (share >= 2048) {
        t1 = time([&](const uint8_t* w) { tiled_kernel<1><<<blocks, 256>>>(w, share, out); });
        t2 = time([&](const uint8_t* w) { tiled_kernel<2><<<blocks, 256>>>(w, share, out); });
        t4 = time([&](const uint8_t* w) { tiled_kernel<4><<<blocks, 256>>>(w, share, out); });
      }
      printf("  split %2d blocks %5d steps %4ld | rows D1 %6.2f D1-nohint %6.2f D2 %6.2f D4 %6.2f | tiled D1 %6.2f D2 %6.2f D4 %6.2f us\n",
             split, blocks, (long)(s.row_bytes / split / 64), r1, r1p, r2, r4, t1, t2, t4);
    }
    CK(cudaFree(buf));
  }
  return 0;
}
