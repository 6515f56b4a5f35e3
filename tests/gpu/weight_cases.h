// The stored weight formats the GPU kernel tests run over, one case per format, dtype
// and scale encoding, named for gtest.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "model/weights.h"

namespace keel::cuda {

struct WeightCase {
  WeightFormat format;
  DType dtype;
  ScaleFormat scales;
  const char* name;
};

inline const WeightCase kF32{WeightFormat::f32, DType::f32, ScaleFormat::ue8m0, "f32"};
inline const WeightCase kBf16{WeightFormat::bf16, DType::bf16, ScaleFormat::ue8m0, "bf16"};
inline const WeightCase kF16{WeightFormat::bf16, DType::f16, ScaleFormat::ue8m0, "f16"};  // a float table stored f16
inline const WeightCase kFp8Ue8m0{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::ue8m0, "fp8_ue8m0"};
inline const WeightCase kFp8F32{WeightFormat::fp8_block, DType::f8_e4m3, ScaleFormat::f32, "fp8_f32"};
inline const WeightCase kMxfp4{WeightFormat::mxfp4, DType::i8, ScaleFormat::ue8m0, "mxfp4"};
inline const WeightCase kNvfp4{WeightFormat::nvfp4, DType::u8, ScaleFormat::ue8m0, "nvfp4"};

inline bool is_fp4(const WeightCase& c) { return c.format == WeightFormat::mxfp4 || c.format == WeightFormat::nvfp4; }

// For INSTANTIATE_TEST_SUITE_P's name generator.
inline std::string case_name(const ::testing::TestParamInfo<WeightCase>& info) { return info.param.name; }

}  // namespace keel::cuda
