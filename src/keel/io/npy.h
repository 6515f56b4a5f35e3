// NumPy .npy files (format 1.0/2.0, little-endian, C order): token ids in, logits out.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/tensor.h"

namespace keel {

// A 1-D array of int32 or int64 ids (int64 values must fit in int32). Errors name the file.
std::vector<int32_t> read_npy_ids(const std::string& path);

// Writes float32 `values` with `shape` (row-major).
void write_npy_f32(const std::string& path, std::span<const float> values, const Shape& shape);

// Token ids from a .npy file, or else from a text file of integers separated by
// whitespace or commas.
std::vector<int32_t> read_ids(const std::string& path);

}  // namespace keel
