#include "cuda/device.h"

#include <cuda_runtime.h>

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

}  // namespace keel::cuda
