// Paged sequence state (docs/serve.md): every row of a sequence's state (ring, compressed
// entries, indexer keys, open windows) lives in fixed-size blocks of one pool, and each
// row array keeps a block table. Blocks are shared by reference count, so a prefix-cache
// snapshot or a speculative mark is a copy of block tables; a block is copied only when
// a holder writes into it while another still holds it (copy on write).
//
// BlockAllocator is the bookkeeping (ids, reference counts, a capacity); a pool adds the
// storage. The capacity is the state budget: allocation past it fails, and the serving
// engine reserves a step's worst-case growth (Model::blocks_needed) before running it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

namespace keel {

class BlockAllocator {
 public:
  static constexpr int64_t unlimited = INT64_MAX;
  explicit BlockAllocator(int64_t capacity_blocks = unlimited) : capacity_(capacity_blocks) {}
  virtual ~BlockAllocator() = default;

  // A block with one reference. Error(out_of_memory) at capacity.
  int32_t allocate();
  void retain(int32_t block);
  void release(int32_t block);
  bool shared(int32_t block) const;  // more than one reference

  int64_t capacity() const;
  int64_t used() const;  // blocks with a reference
  int64_t available() const { return capacity() - used(); }
  // Error(usage) below the blocks in use.
  void set_capacity(int64_t blocks);

 protected:
  // Storage for block ids [0, blocks) must exist once this returns.
  virtual void grow_storage(int64_t blocks) = 0;

 private:
  mutable std::mutex mutex_;
  int64_t capacity_;
  std::vector<int32_t> references_;  // per block id ever made
  std::vector<int32_t> free_;        // ids with no reference
  int64_t used_ = 0;
};

// Host memory: blocks of `block_floats` floats in arenas that are never moved, made as
// blocks are first needed (up to the capacity).
class HostBlockPool final : public BlockAllocator {
 public:
  explicit HostBlockPool(int64_t block_floats, int64_t capacity_blocks = unlimited);
  int64_t block_floats() const { return block_floats_; }
  uint64_t block_bytes() const { return static_cast<uint64_t>(block_floats_) * sizeof(float); }
  float* data(int32_t block) const {
    return arenas_[block / kArenaBlocks].get() + static_cast<int64_t>(block % kArenaBlocks) * block_floats_;
  }
  void copy_block(int32_t to, int32_t from) const;

 private:
  static constexpr int kArenaBlocks = 64;
  void grow_storage(int64_t blocks) override;
  int64_t block_floats_;
  std::vector<std::unique_ptr<float[]>> arenas_;
};

// Error(usage): rows of `width` floats do not fit blocks of `block_floats` (0, 0: no pool).
[[noreturn]] void fail_width(int64_t width, int64_t block_floats);

// A growable array of rows of `width` floats in a pool's blocks: as many rows per block
// as fit. Copies share blocks (a reference each); writes go through `write_row`, which
// first copies a block still shared with another holder. `Pool` is HostBlockPool, or a
// device pool (cuda/device_block_pool.h) whose row pointers are device addresses.
template <typename Pool>
class BasicPagedRows {
 public:
  BasicPagedRows() = default;  // holds nothing and cannot grow
  BasicPagedRows(std::shared_ptr<Pool> pool, int64_t width) : pool_(std::move(pool)), width_(width) {
    if (width < 1 || width > pool_->block_floats()) fail_width(width, pool_->block_floats());
    per_block_ = pool_->block_floats() / width;
  }
  BasicPagedRows(const BasicPagedRows& o)
      : pool_(o.pool_), width_(o.width_), per_block_(o.per_block_), rows_(o.rows_), blocks_(o.blocks_) {
    for (const int32_t b : blocks_) pool_->retain(b);
  }
  BasicPagedRows& operator=(const BasicPagedRows& o) {
    if (this != &o) *this = BasicPagedRows(o);
    return *this;
  }
  BasicPagedRows(BasicPagedRows&& o) noexcept { take(o); }
  BasicPagedRows& operator=(BasicPagedRows&& o) noexcept {
    if (this != &o) {
      release_all();
      take(o);
    }
    return *this;
  }
  ~BasicPagedRows() { release_all(); }

  int64_t size() const { return rows_; }
  bool empty() const { return rows_ == 0; }
  int64_t width() const { return width_; }
  int64_t rows_per_block() const { return per_block_; }
  std::span<const int32_t> blocks() const { return blocks_; }
  uint64_t bytes() const { return pool_ ? blocks_.size() * pool_->block_bytes() : 0; }

  const float* row(int64_t i) const { return pool_->data(blocks_[i / per_block_]) + (i % per_block_) * width_; }
  const float* block_data(size_t b) const { return pool_->data(blocks_[b]); }
  float* write_row(int64_t i) {  // copy on write
    int32_t& block = blocks_[i / per_block_];
    if (pool_->shared(block)) {  // another holder keeps the old contents
      const int32_t copy = pool_->allocate();
      pool_->copy_block(copy, block);
      pool_->release(block);
      block = copy;
    }
    return pool_->data(block) + (i % per_block_) * width_;
  }
  // Grows with rows of unspecified contents, or drops the last rows (and their blocks).
  void resize(int64_t rows) {
    if (rows > 0 && !pool_) fail_width(0, 0);
    const auto blocks = static_cast<size_t>((rows + per_block_ - 1) / per_block_);
    while (blocks_.size() > blocks) {
      pool_->release(blocks_.back());
      blocks_.pop_back();
    }
    blocks_.reserve(blocks);
    while (blocks_.size() < blocks) blocks_.push_back(pool_->allocate());
    rows_ = rows;
  }
  void clear() { resize(0); }

  // Blocks that `grow_to` rows would allocate at most, copies of shared blocks included
  // when `writes_shared` (the rows already held may be written).
  int64_t blocks_to_grow(int64_t grow_to, bool writes_shared) const {
    const auto held = static_cast<int64_t>(blocks_.size());
    int64_t n = std::max<int64_t>(0, (grow_to + per_block_ - 1) / per_block_ - held);
    if (writes_shared) {
      for (const int32_t b : blocks_) n += pool_->shared(b);
    } else if (held > 0 && rows_ % per_block_ != 0 && pool_->shared(blocks_.back())) {
      ++n;  // the partly filled last block is written by the next row
    }
    return n;
  }

 private:
  void take(BasicPagedRows& o) {
    pool_ = std::move(o.pool_);
    width_ = o.width_;
    per_block_ = o.per_block_;
    rows_ = std::exchange(o.rows_, 0);
    blocks_ = std::move(o.blocks_);
    o.blocks_.clear();
  }
  void release_all() {
    for (const int32_t b : blocks_) pool_->release(b);
    blocks_.clear();
    rows_ = 0;
  }
  std::shared_ptr<Pool> pool_;
  int64_t width_ = 0, per_block_ = 1, rows_ = 0;
  std::vector<int32_t> blocks_;
};

// Host rows, with what the CPU forward pass needs besides.
class PagedRows : public BasicPagedRows<HostBlockPool> {
 public:
  using BasicPagedRows::BasicPagedRows;
  void push_back(const float* row) {
    resize(size() + 1);
    std::copy_n(row, width(), write_row(size() - 1));
  }
  // Row pointers of rows [0, n), for ops that take a key list.
  void row_pointers(int64_t n, std::vector<const float*>& out) const {
    out.clear();
    out.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out.push_back(row(i));
  }
};

}  // namespace keel
