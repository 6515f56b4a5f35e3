// Size checks at the quantization API boundary: a wrong buffer size is a caller bug,
// reported as Error(usage) naming the buffer, never an out-of-bounds write.
#pragma once

#include <cstdint>
#include <string>

#include "base/error.h"

namespace keel {

inline void expect_size(uint64_t actual, uint64_t expected, const char* what) {
  if (actual != expected)
    fail(ErrorCode::usage, {.field = what},
         "buffer has " + std::to_string(actual) + " elements, expected " + std::to_string(expected));
}

inline void expect_divisible(int64_t value, int64_t divisor, const char* what) {
  if (value <= 0 || value % divisor != 0)
    fail(ErrorCode::usage, {.field = what},
         std::to_string(value) + " is not a positive multiple of " + std::to_string(divisor));
}

// Row `row` of a packed e2m1 matrix with `cols` inputs and one scale per `block` lies
// inside both buffers.
inline void expect_row(int64_t row, uint64_t packed_bytes, uint64_t scale_count, int64_t cols, int block) {
  const uint64_t rows = packed_bytes / static_cast<uint64_t>(cols / 2);
  if (row < 0 || static_cast<uint64_t>(row) >= rows || scale_count < rows * static_cast<uint64_t>(cols / block))
    fail(ErrorCode::usage, {.field = "row"},
         "row " + std::to_string(row) + " is outside a packed matrix of " + std::to_string(rows) + " rows");
}

}  // namespace keel
