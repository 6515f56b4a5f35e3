// Host-made values for the device, staged in page-locked memory and moved in few
// launches (Staging).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/forward_ops.h"

namespace keel::cuda {

// A call's host-made values for the device (key lists, block tables, copy jobs), staged
// in page-locked chunks that device chunks mirror at the same offsets: stage() returns
// where the values will be, flush() moves everything staged since the last flush, in
// one launch a chunk. A small copy costs the stream about the same whatever its size
// (3 us by kernel, 3 to 10 by DMA; docs/perf.md), so an attention core stages all it
// needs and flushes once. Chunks are reused once the call has ended: its final copy
// back synchronizes the stream, or (a pipelined call) the next call stages into another
// Staging (swap).
class Staging {
 public:
  // A flush of more bytes of a chunk than this goes by DMA (measured up to 256 KB: the kernel wins).
  static constexpr size_t kKernelMoveMax = size_t{1} << 20;

  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (const Chunk& c : chunks_) cudaFreeHost(c.host), cudaFree(c.device);
  }
  void swap(Staging& other) noexcept {
    std::swap(chunks_, other.chunks_);
    std::swap(current_, other.current_);
    std::swap(flushed_chunk_, other.flushed_chunk_);
    std::swap(flushed_at_, other.flushed_at_);
  }
  void reset() {
    for (Chunk& c : chunks_) c.used = 0;
    current_ = flushed_chunk_ = flushed_at_ = 0;
  }
  // The device address `values` will have after the next flush (null when empty).
  template <typename T>
  T* stage(std::span<const T> values) {
    const size_t bytes = values.size_bytes();
    if (bytes == 0) return nullptr;
    Chunk& c = take(bytes);
    std::memcpy(c.host + c.used, values.data(), bytes);
    T* at = reinterpret_cast<T*>(c.device + c.used);
    c.used += (bytes + kAlign - 1) / kAlign * kAlign;
    return at;
  }
  // What was staged since the last flush goes to the device, in order on `stream`.
  void flush(cudaStream_t stream) {
    for (size_t i = flushed_chunk_; i < chunks_.size() && i <= current_; ++i) {
      const Chunk& c = chunks_[i];
      const size_t from = i == flushed_chunk_ ? flushed_at_ : 0;
      if (c.used - from > kKernelMoveMax) {  // large (a long prefill's key lists): DMA
        check_api(cudaMemcpyAsync(c.device + from, c.host + from, c.used - from, cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync");
      } else {
        copy_bytes(c.device + from, c.mapped + from, static_cast<int64_t>(c.used - from), stream);
      }
    }
    flushed_chunk_ = current_;
    flushed_at_ = chunks_.empty() ? 0 : chunks_[current_].used;
  }

 private:
  static constexpr size_t kAlign = 256;
  struct Chunk {
    uint8_t *host, *mapped, *device;  // mapped: the host bytes' address on the device
    size_t bytes, used = 0;
  };
  Chunk& take(size_t bytes) {
    while (current_ < chunks_.size() && chunks_[current_].used + bytes > chunks_[current_].bytes) ++current_;
    if (current_ == chunks_.size()) {
      Chunk c{nullptr, nullptr, nullptr, std::max<size_t>((bytes + kAlign - 1) / kAlign * kAlign, size_t{1} << 20)};
      check_api(cudaHostAlloc(reinterpret_cast<void**>(&c.host), c.bytes, cudaHostAllocMapped), "cudaHostAlloc");
      check_api(cudaHostGetDevicePointer(reinterpret_cast<void**>(&c.mapped), c.host, 0), "cudaHostGetDevicePointer");
      if (const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&c.device), c.bytes); e != cudaSuccess) {
        cudaFreeHost(c.host);
        check_api(e, "cudaMalloc");
      }
      chunks_.push_back(c);
    }
    return chunks_[current_];
  }
  std::vector<Chunk> chunks_;
  size_t current_ = 0, flushed_chunk_ = 0, flushed_at_ = 0;
};

}  // namespace keel::cuda
