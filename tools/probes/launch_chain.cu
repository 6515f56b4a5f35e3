// Probe: a chain of dependent weight reads, as a decode step's products are, each kernel
// reading its own copy. How much do programmatic dependent launch and loading weights
// before griddepcontrol.wait (the first step into registers, an L2 prefetch of the
// share, the block's whole slice into shared memory) overlap the launches? Loads only.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o launch_chain launch_chain.cu
//   ./launch_chain          (docs/perf.md has its figures on one H200)
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#include "check.cuh"

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ uint4 ldw(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// mode 0: rows pattern (32 rows x 64 B per warp step, 1 step ahead), first load before the wait.
// mode 1: mode 0 + prefetch.global.L2 of the warp's share before the wait.
// mode 2: the block's contiguous slice into shared memory by cp.async before the wait, then read from smem.
// mode 3: mode 2 without PDL waits (plain launches): baseline of the same kernel.
template <int kMode>
__global__ void __launch_bounds__(256) chain_kernel(const uint8_t* w, int64_t row_bytes, int split, int64_t slice, uint32_t* io) {
  extern __shared__ uint4 smem[];
  uint32_t acc = 0;
  if constexpr (kMode <= 1) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t gw = blockIdx.x * 8 + warp;
    const int64_t row0 = gw / split * 32, share = gw % split;
    const int64_t share_bytes = row_bytes / split;
    const int steps = share_bytes / 64;
    const uint8_t* p[4];
    for (int i = 0; i < 4; ++i) p[i] = w + (row0 + g + 8 * i) * row_bytes + share * share_bytes + 16 * t;
    if constexpr (kMode == 1) {
      const int64_t lines = share_bytes / 128;
      for (int64_t e = lane; e < 32 * lines; e += 32)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w + (row0 + e / lines) * row_bytes + share * share_bytes + e % lines * 128));
    }
    uint4 cur[4];
    for (int i = 0; i < 4; ++i) cur[i] = ldw(p[i]);
    pdl_launch();
    pdl_wait();
    acc = io[0];
    for (int s = 0; s < steps; ++s) {
      uint4 nxt[4];
      const int n = min(s + 1, steps - 1);
      for (int i = 0; i < 4; ++i) nxt[i] = ldw(p[i] + 64 * n);
      for (int i = 0; i < 4; ++i) acc ^= cur[i].x ^ cur[i].y ^ cur[i].z ^ cur[i].w, cur[i] = nxt[i];
    }
  } else {
    const uint8_t* base = w + blockIdx.x * slice;
    const int n16 = slice / 16;
    for (int i = threadIdx.x; i < n16; i += 256) {
      const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem + i));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(base + 16 * i));
    }
    asm volatile("cp.async.commit_group;");
    if constexpr (kMode == 2) { pdl_launch(); pdl_wait(); }
    acc = io[0];
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    for (int i = threadIdx.x; i < n16; i += 256) { const uint4 v = smem[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  if (acc == 0x12345678u) io[1] = acc;
}

template <typename K>
void launch(K kernel, int blocks, size_t smem, bool pdl, const uint8_t* w, int64_t row_bytes, int split, int64_t slice, uint32_t* io) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = blocks; c.blockDim = 256; c.dynamicSmemBytes = smem; c.stream = 0; c.attrs = &a; c.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&c, kernel, w, row_bytes, split, slice, io));
}

int main() {
  uint32_t* io; CK(cudaMalloc(&io, 8)); CK(cudaMemset(io, 0, 8));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  struct Shape { const char* name; int64_t rows, row_bytes; int split; } shapes[] = {
      {"32 MiB (wo_b 4096x8192, split 8)", 4096, 8192, 8}, {"4 MiB (wq_a 1024x4096, split 8)", 1024, 4096, 8},
      {"4 MiB (an expert 2048x2048 B, split 8)", 2048, 2048, 8}};
  CK(cudaFuncSetAttribute(chain_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(chain_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  for (auto& s : shapes) {
    const int64_t bytes = s.rows * s.row_bytes;
    const int chain = static_cast<int>(std::min<int64_t>(64, (int64_t{1280} << 20) / bytes));
    uint8_t* buf; CK(cudaMalloc(&buf, bytes * chain)); CK(cudaMemset(buf, 1, bytes * chain));
    auto time = [&](auto body) {
      body(); CK(cudaDeviceSynchronize());
      cudaEventRecord(e0);
      for (int r = 0; r < 3; ++r) body();
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      return ms * 1e3 / (3 * chain);  // us per kernel
    };
    printf("%s, chains of %d kernels: us per kernel (GB/s)\n", s.name, chain);
    const int row_blocks = static_cast<int>(s.rows / 32 * s.split / 8);
    for (int pdl = 0; pdl < 2; ++pdl) {
      float t0 = time([&] { for (int k = 0; k < chain; ++k) launch(chain_kernel<0>, row_blocks, 0, pdl, buf + k * bytes, s.row_bytes, s.split, 0, io); });
      float t1 = time([&] { for (int k = 0; k < chain; ++k) launch(chain_kernel<1>, row_blocks, 0, pdl, buf + k * bytes, s.row_bytes, s.split, 0, io); });
      printf("  rows, %s: weights after the wait %7.2f us (%5.0f)   + L2 prefetch before it %7.2f us (%5.0f)\n", pdl ? "PDL   " : "plain ", t0, bytes / t0 / 1e3, t1, bytes / t1 / 1e3);
    }
    for (int64_t slice_kb : {16, 32, 64, 96}) {
      const int64_t slice = slice_kb * 1024;
      const int blocks = static_cast<int>(bytes / slice);
      float t2 = time([&] { for (int k = 0; k < chain; ++k) launch(chain_kernel<2>, blocks, slice, true, buf + k * bytes, 0, 0, slice, io); });
      float t3 = time([&] { for (int k = 0; k < chain; ++k) launch(chain_kernel<3>, blocks, slice, false, buf + k * bytes, 0, 0, slice, io); });
      printf("  smem slices of %3ld KiB (%5d blocks): PDL, loads before the wait %7.2f us (%5.0f)   plain %7.2f us (%5.0f)\n", (long)slice_kb, blocks, t2, bytes / t2 / 1e3, t3, bytes / t3 / 1e3);
    }
    CK(cudaFree(buf));
  }
  return 0;
}
