// Paged sequence state on a GPU (model/block_pool.h, in device memory): blocks of one
// size in arenas that are never moved, so a block's address is fixed for its life and
// the attention and indexer kernels reach rows through per-sequence block tables
// (cuda/paged_rows.h). Copies on write are device-to-device copies on the pool's
// stream, ordered before the launches that follow on it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "model/block_pool.h"

namespace keel::cuda {

class DeviceBlockPool final : public BlockAllocator {
 public:
  // Blocks of `block_floats` on CUDA device `device`, arenas made as blocks are first
  // needed (up to the capacity).
  DeviceBlockPool(int device, int64_t block_floats, cudaStream_t stream, int64_t capacity_blocks = unlimited);
  ~DeviceBlockPool() override;
  DeviceBlockPool(const DeviceBlockPool&) = delete;
  DeviceBlockPool& operator=(const DeviceBlockPool&) = delete;

  int64_t block_floats() const { return block_floats_; }
  uint64_t block_bytes() const { return static_cast<uint64_t>(block_floats_) * sizeof(float); }
  float* data(int32_t block) const {
    return arenas_[block / kArenaBlocks] + static_cast<int64_t>(block % kArenaBlocks) * block_floats_;
  }
  void copy_block(int32_t to, int32_t from) const;

 private:
  static constexpr int kArenaBlocks = 256;
  void grow_storage(int64_t blocks) override;
  int device_;
  int64_t block_floats_;
  cudaStream_t stream_;
  std::vector<float*> arenas_;
};

using DevicePagedRows = BasicPagedRows<DeviceBlockPool>;

}  // namespace keel::cuda
