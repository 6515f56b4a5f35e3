// Rows reached through block tables (paged sequence state: cuda/device_block_pool.h):
// row r of table t is tables[t][r / rows_per_block] + (r % rows_per_block) * width,
// every pointer a device address. The attention kernels get one table per sequence,
// the indexer one per token.
#pragma once

#include <cstdint>

namespace keel::cuda {

struct PagedTables {
  const float* const* const* tables = nullptr;  // device array of device tables of block pointers
  int rows_per_block = 0;
};

#ifdef __CUDACC__
__device__ inline const float* paged_row(const float* const* table, int rows_per_block, int64_t r, int width) {
  return table[r / rows_per_block] + (r % rows_per_block) * width;
}
#endif

}  // namespace keel::cuda
