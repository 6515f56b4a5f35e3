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

}  // namespace keel::cuda
