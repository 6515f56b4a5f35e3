#include "model/block_pool.h"

#include <algorithm>
#include <fmt/format.h>

#include "base/error.h"

namespace keel {

int32_t BlockAllocator::allocate() {
  std::lock_guard lock(mutex_);
  if (used_ >= capacity_) {
    fail(ErrorCode::out_of_memory, {},
         fmt::format("the sequence-state pool is full ({} blocks): raise the state budget", capacity_));
  }
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    if (references_.size() >= static_cast<size_t>(INT32_MAX)) fail(ErrorCode::out_of_memory, {}, "too many state blocks");
    id = static_cast<int32_t>(references_.size());
    grow_storage(id + 1);
    references_.push_back(0);
  }
  references_[id] = 1;
  ++used_;
  return id;
}

void BlockAllocator::retain(int32_t block) {
  std::lock_guard lock(mutex_);
  ++references_.at(block);
}

void BlockAllocator::release(int32_t block) {
  std::lock_guard lock(mutex_);
  if (--references_.at(block) == 0) {
    free_.push_back(block);
    --used_;
  }
}

bool BlockAllocator::shared(int32_t block) const {
  std::lock_guard lock(mutex_);
  return references_.at(block) > 1;
}

int64_t BlockAllocator::capacity() const {
  std::lock_guard lock(mutex_);
  return capacity_;
}

int64_t BlockAllocator::used() const {
  std::lock_guard lock(mutex_);
  return used_;
}

void BlockAllocator::set_capacity(int64_t blocks) {
  std::lock_guard lock(mutex_);
  if (blocks < used_) {
    fail(ErrorCode::usage, {}, fmt::format("a state pool of {} blocks cannot hold the {} in use", blocks, used_));
  }
  capacity_ = blocks;
}

HostBlockPool::HostBlockPool(int64_t block_floats, int64_t capacity_blocks)
    : BlockAllocator(capacity_blocks), block_floats_(block_floats) {
  if (block_floats < 1) fail(ErrorCode::usage, {}, "a state block holds at least one float");
}

void HostBlockPool::grow_storage(int64_t blocks) {
  while (static_cast<int64_t>(arenas_.size()) * kArenaBlocks < blocks) {
    arenas_.push_back(std::make_unique_for_overwrite<float[]>(static_cast<size_t>(kArenaBlocks * block_floats_)));
  }
}

void HostBlockPool::copy_block(int32_t to, int32_t from) const { std::copy_n(data(from), block_floats_, data(to)); }

void fail_width(int64_t width, int64_t block_floats) {
  if (block_floats == 0) fail(ErrorCode::usage, {}, "state rows without a pool cannot grow");
  fail(ErrorCode::usage, {}, fmt::format("rows of {} floats do not fit state blocks of {}", width, block_floats));
}

}  // namespace keel
