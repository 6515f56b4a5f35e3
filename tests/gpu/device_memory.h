// Device buffers for the GPU tests: copies in, NaN-poisoned outputs, copies back.
// Allocations are left to the process's end (tests are short-lived).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

// Device copies freed together when the scope ends.
struct DeviceScope {
  std::vector<void*> owned;
  template <typename T>
  T* copy(const std::vector<T>& v) {
    T* p = device_copy(v);
    owned.push_back(const_cast<void*>(static_cast<const void*>(p)));
    return p;
  }
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    for (void* p : owned) cudaFree(p);
  }
};

// `rows` (of `width` floats) as paged state: blocks of `rows_per_block` rows stored in
// reverse order in one device buffer (the unused floats after the last row poisoned),
// and the device table of their addresses, in row order (cuda/paged_rows.h); both
// freed with `scope`.
inline const float* const* scattered_table(DeviceScope& scope, const std::vector<float>& rows, int width,
                                           int rows_per_block) {
  const size_t count = rows.size() / width, per_block = size_t(rows_per_block) * width;
  const size_t blocks = (count + rows_per_block - 1) / rows_per_block;
  std::vector<float> stored(blocks * per_block, std::nanf(""));
  for (size_t r = 0; r < count; ++r) {
    const size_t slot = (blocks - 1 - r / rows_per_block) * per_block + (r % rows_per_block) * width;
    std::copy_n(&rows[r * width], width, &stored[slot]);
  }
  const float* arena = scope.copy(stored);
  std::vector<const float*> table(blocks);
  for (size_t b = 0; b < blocks; ++b) table[b] = arena + (blocks - 1 - b) * per_block;
  return scope.copy(table);
}

}  // namespace keel::cuda
