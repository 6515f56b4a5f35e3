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
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int r = 0; r < runs + 1; ++r) {  // the first copy warms up
    check(cudaEventRecord(start), "cudaEventRecord");
    check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (r > 0) best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / (best_ms * 1e-3);
}

}  // namespace keel::cuda
