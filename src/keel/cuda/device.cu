#include "cuda/device.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/check.cuh"

namespace keel::cuda {

std::vector<DeviceInfo> devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return {};
  }
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    out.push_back({i, p.name, p.major, p.minor, p.multiProcessorCount, static_cast<uint64_t>(p.totalGlobalMem)});
  }
  return out;
}

namespace {

// Seconds of the fastest of `runs` calls of `work` (work enqueued on the default stream),
// timed with CUDA events after one call that warms up.
template <typename Work>
double best_seconds(int runs, Work&& work) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int r = 0; r < runs + 1; ++r) {
    check(cudaEventRecord(start), "cudaEventRecord");
    work();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (r > 0) best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best_ms * 1e-3;
}

constexpr int kMmaChains = 8;      // independent accumulators per warp: enough to fill the pipes
constexpr int kMmaSteps = 4096;   // mma rounds per warp

// Each warp runs kMmaSteps rounds of kMmaChains independent m16n8k16 MMAs on register
// operands; the sum of the accumulators is stored so nothing is optimized away.
__global__ void mma_loop(float* out) {
#if __CUDA_ARCH__ >= 800
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ (threadIdx.x << i);  // bf16 pairs near 1
  for (int i = 0; i < 2; ++i) b[i] = 0x3f803f80u ^ (threadIdx.x << (i + 4));
  float c[kMmaChains][4] = {};
  for (int step = 0; step < kMmaSteps; ++step) {
#pragma unroll
    for (int j = 0; j < kMmaChains; ++j) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float sum = 0.0f;
  for (int j = 0; j < kMmaChains; ++j) sum += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
#endif
}

}  // namespace

double mma_bf16_throughput(int device, int runs) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  const int blocks = p.multiProcessorCount * 8, threads = 128;
  float* out = nullptr;
  check(cudaMalloc(&out, sizeof(float) * blocks * threads), "cudaMalloc");
  const double seconds = best_seconds(runs, [&] {
    mma_loop<<<blocks, threads>>>(out);
    check(cudaGetLastError(), "mma_loop launch");
  });
  cudaFree(out);
  return 2.0 * 16 * 8 * 16 * kMmaChains * double{kMmaSteps} * blocks * (threads / kWarp) / seconds;
}

MemoryInfo memory_info(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return {free, total};
}

double copy_bandwidth(int device, uint64_t bytes, int runs) {
  check(cudaSetDevice(device), "cudaSetDevice");
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  check(cudaMemset(a, 1, bytes), "cudaMemset");
  const double seconds =
      best_seconds(runs, [&] { check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy"); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / seconds;
}

}  // namespace keel::cuda
