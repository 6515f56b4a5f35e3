// The CUDA devices present, as the plan resolver and the tests see them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;
  uint64_t memory_bytes = 0;
};

// Empty when there is no driver or no GPU (never throws for that).
std::vector<DeviceInfo> devices();

// Free and total memory of `device` now (cudaMemGetInfo). Throws on a CUDA failure.
struct MemoryInfo {
  uint64_t free = 0, total = 0;
};
MemoryInfo memory_info(int device);

// Dense bf16 tensor-core throughput of `device` with the mma.sync instruction keel's
// GEMM kernels use (m16n8k16, f32 accumulate), FLOP/s, best of `runs`: the roofline for
// prefill. (Hopper's wgmma peaks higher; this is what mma.sync code can reach.)
double mma_bf16_throughput(int device, int runs);

// Device-to-device copy bandwidth of `device`, bytes read + written per second, best of
// `runs` copies of `bytes` (the roofline a decode step's weight reads are held to).
// Throws std::runtime_error on a CUDA failure.
double copy_bandwidth(int device, uint64_t bytes, int runs);

}  // namespace keel::cuda
