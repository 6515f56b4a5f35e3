// A tensor view: where the bytes live, their element type, shape and strides. keel
// has no general tensor library; ops take views and plain pointers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace keel {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape);
std::string to_string(const Shape& shape);  // "[2, 3]"

enum class Memory : uint8_t {
  host,    // ordinary host memory
  mapped,  // a read-only memory-mapped file (checkpoint tensors)
  device,  // GPU global memory
};

struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  std::vector<int64_t> strides;  // in elements; row-major contiguous when made by `contiguous`
  Memory memory = Memory::host;

  static TensorView contiguous(const void* data, DType dtype, Shape shape, Memory memory);

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t numel() const { return keel::numel(shape); }
  bool is_contiguous() const;
  uint64_t nbytes() const;  // of a contiguous view
  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(data), nbytes()}; }
};

// An owning, 64-byte aligned host allocation (zero-filled).
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes);

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  template <typename T>
  std::span<T> as() { return {reinterpret_cast<T*>(data_.get()), size_ / sizeof(T)}; }
  template <typename T>
  std::span<const T> as() const { return {reinterpret_cast<const T*>(data_.get()), size_ / sizeof(T)}; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> data_;
  size_t size_ = 0;
};

}  // namespace keel
