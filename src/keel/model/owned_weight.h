// A weight that owns its bytes, quantized from f32 values into any stored format: the
// input of kernel tests and benchmarks (a checkpoint's weights are views instead).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/weights.h"

namespace keel {

class OwnedWeight {
 public:
  // `values` [out, in] row-major. `dtype` picks f32/bf16/f16 for float formats.
  OwnedWeight(std::span<const float> values, int64_t out, int64_t in, WeightFormat format,
              DType dtype = DType::bf16, ScaleFormat scale_format = ScaleFormat::ue8m0);
  OwnedWeight(const OwnedWeight&) = delete;
  OwnedWeight& operator=(const OwnedWeight&) = delete;

  const Weight& weight() const { return weight_; }
  uint64_t bytes() const { return data_.size() + scale_.size(); }

 private:
  TensorSpec spec_;
  std::vector<uint8_t> data_, scale_;
  Weight weight_;
};

}  // namespace keel
