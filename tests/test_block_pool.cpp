// The paged state pool (model/block_pool.h): reference counts, copy on write, the
// capacity, and the growth bound the serving engine reserves by.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "model/block_pool.h"
#include "testing.h"

namespace keel {
namespace {

std::vector<float> row_of(float first, int64_t width) {
  std::vector<float> r(static_cast<size_t>(width));
  std::iota(r.begin(), r.end(), first);
  return r;
}

std::vector<float> read(const PagedRows& rows, int64_t i) {
  return std::vector<float>(rows.row(i), rows.row(i) + rows.width());
}

TEST(BlockPool, RowsFillBlocksAndFreeThemWhenDropped) {
  auto pool = std::make_shared<HostBlockPool>(12);
  PagedRows rows(pool, 5);  // two rows per block, two floats of each block unused
  EXPECT_EQ(rows.rows_per_block(), 2);
  for (int i = 0; i < 5; ++i) rows.push_back(row_of(10.0f * i, 5).data());
  EXPECT_EQ(pool->used(), 3);
  EXPECT_EQ(rows.bytes(), 3 * 12 * sizeof(float));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(read(rows, i), row_of(10.0f * i, 5)) << i;
  rows.resize(2);
  EXPECT_EQ(pool->used(), 1);
  rows.clear();
  EXPECT_EQ(pool->used(), 0);
}

TEST(BlockPool, CopiesShareBlocksAndCopyOnlyTheBlockWritten) {
  auto pool = std::make_shared<HostBlockPool>(8);
  PagedRows a(pool, 4);
  for (int i = 0; i < 4; ++i) a.push_back(row_of(i, 4).data());  // two blocks
  PagedRows b = a;
  EXPECT_EQ(pool->used(), 2);
  std::copy_n(row_of(100, 4).data(), 4, b.write_row(3));  // copies block 1 only
  EXPECT_EQ(pool->used(), 3);
  EXPECT_EQ(read(a, 3), row_of(3, 4));
  EXPECT_EQ(read(b, 3), row_of(100, 4));
  EXPECT_EQ(read(b, 2), row_of(2, 4));  // the rest of the copied block came along
  EXPECT_EQ(a.blocks()[0], b.blocks()[0]);
  // Appending to a shared, partly filled block copies it too.
  PagedRows c(pool, 4);
  c.push_back(row_of(0, 4).data());
  PagedRows d = c;
  EXPECT_EQ(d.blocks_to_grow(2, false), 1);
  d.push_back(row_of(7, 4).data());
  EXPECT_NE(c.blocks()[0], d.blocks()[0]);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(read(d, 0), row_of(0, 4));
  a = PagedRows();
  b = PagedRows();
  c = PagedRows();
  d = PagedRows();
  EXPECT_EQ(pool->used(), 0);
}

TEST(BlockPool, CapacityIsEnforcedAndCannotShrinkBelowUse) {
  auto pool = std::make_shared<HostBlockPool>(4, 2);
  PagedRows rows(pool, 4);
  rows.push_back(row_of(0, 4).data());
  rows.push_back(row_of(1, 4).data());
  KEEL_EXPECT_ERROR(rows.push_back(row_of(2, 4).data()), ErrorCode::out_of_memory);
  KEEL_EXPECT_ERROR(pool->set_capacity(1), ErrorCode::usage);
  pool->set_capacity(3);
  rows.push_back(row_of(2, 4).data());
  EXPECT_EQ(pool->available(), 0);
}

TEST(BlockPool, FreedBlocksAreReused) {
  auto pool = std::make_shared<HostBlockPool>(4, 1);
  for (int i = 0; i < 3; ++i) {
    PagedRows rows(pool, 2);
    rows.push_back(row_of(i, 2).data());
    rows.push_back(row_of(i, 2).data());
    EXPECT_EQ(read(rows, 1), row_of(i, 2));
  }
  EXPECT_EQ(pool->used(), 0);
}

TEST(BlockPool, RowsWiderThanABlockAreRefused) {
  auto pool = std::make_shared<HostBlockPool>(4);
  KEEL_EXPECT_ERROR(PagedRows(pool, 5), ErrorCode::usage);
  PagedRows none;
  KEEL_EXPECT_ERROR(none.resize(1), ErrorCode::usage);
}

}  // namespace
}  // namespace keel
