// An owning, growable array in device memory for the GPU forward pass and its state.
// Growth keeps the contents (a device-to-device copy); nothing is zeroed.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace keel::cuda {

inline void check_api(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { reserve(n); size_ = n; }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    DeviceBuffer(std::move(o)).swap(*this);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  uint64_t bytes() const { return capacity_ * sizeof(T); }

  // At least n elements of capacity, keeping the first size() elements.
  void reserve(size_t n) {
    if (n <= capacity_) return;
    const size_t grown = std::max(n, capacity_ + capacity_ / 2);
    T* fresh = nullptr;
    check_api(cudaMalloc(reinterpret_cast<void**>(&fresh), grown * sizeof(T)), "cudaMalloc");
    if (size_ > 0) check_api(cudaMemcpy(fresh, data_, size_ * sizeof(T), cudaMemcpyDeviceToDevice), "cudaMemcpy");
    if (data_) cudaFree(data_);
    data_ = fresh;
    capacity_ = grown;
  }
  // n elements; the first min(n, size()) keep their values.
  void resize(size_t n) {
    reserve(n);
    size_ = n;
  }
  // Replaces the contents with `host` (asynchronous on `stream`; `host` must outlive it
  // unless the stream is synchronized).
  void assign(std::span<const T> host, cudaStream_t stream = nullptr) {
    resize(host.size());
    if (!host.empty()) {
      check_api(cudaMemcpyAsync(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync to device");
    }
  }
  std::vector<T> to_host(cudaStream_t stream = nullptr) const {
    std::vector<T> out(size_);
    if (size_ > 0) {
      check_api(cudaMemcpyAsync(out.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync to host");
    }
    check_api(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return out;
  }
  // A copy of the contents (same capacity), on the current device.
  DeviceBuffer copy() const {
    DeviceBuffer out;
    out.reserve(capacity_);
    out.size_ = size_;
    if (size_ > 0) check_api(cudaMemcpy(out.data_, data_, size_ * sizeof(T), cudaMemcpyDeviceToDevice), "cudaMemcpy");
    return out;
  }
  void swap(DeviceBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0, capacity_ = 0;
};

}  // namespace keel::cuda
