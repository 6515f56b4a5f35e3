// What every CUDA source of keel shares: turning a CUDA status into an exception that
// names the call, and the warp width the kernels are written for.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace keel::cuda {

// Throws std::runtime_error "what: cudaErrorName: description" unless `status` is success.
inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

inline constexpr int kWarp = 32;

}  // namespace keel::cuda
