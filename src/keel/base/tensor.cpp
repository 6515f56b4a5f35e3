#include "base/tensor.h"

#include <cstring>
#include <new>

#include "base/error.h"

namespace keel {

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

TensorView TensorView::contiguous(const void* data, DType dtype, Shape shape, Memory memory) {
  TensorView v{data, dtype, std::move(shape), {}, memory};
  v.strides.resize(v.shape.size());
  int64_t stride = 1;
  for (size_t i = v.shape.size(); i-- > 0;) {
    v.strides[i] = stride;
    stride *= v.shape[i];
  }
  return v;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

uint64_t TensorView::nbytes() const {
  return storage_bytes(dtype, static_cast<uint64_t>(numel())).value_or(0);
}

HostBuffer::HostBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  data_.reset(static_cast<std::byte*>(p));
}

}  // namespace keel
