// Device buffers for the GPU tests: copies in, NaN-poisoned outputs, copies back.
// Allocations are left to the process's end (tests are short-lived).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

namespace keel::cuda {

template <typename T>
T* device_copy(const std::vector<T>& v) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

// n elements with every byte 0xff: NaN for floats, so an unwritten output shows.
template <typename T = float>
T* device_poisoned(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemset(p, 0xff, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

// Waits for the device, then copies n elements back.
template <typename T>
std::vector<T> host_copy(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

}  // namespace keel::cuda
