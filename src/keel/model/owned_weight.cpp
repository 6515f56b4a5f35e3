#include "model/owned_weight.h"

#include <cstring>

#include "base/dtype.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

namespace keel {
namespace {

TensorView view(const std::vector<uint8_t>& bytes, DType dtype, Shape shape) {
  return TensorView::contiguous(bytes.data(), dtype, std::move(shape), Memory::host);
}

}  // namespace

OwnedWeight::OwnedWeight(std::span<const float> values, int64_t out, int64_t in, WeightFormat format, DType dtype,
                         ScaleFormat scale_format)
    : spec_{"owned.weight", {out, in}, TensorRole::linear, format} {
  weight_.spec = &spec_;
  weight_.format = format;
  weight_.scale_format = scale_format;
  const size_t n = values.size();
  switch (format) {
    case WeightFormat::f32:
    case WeightFormat::bf16:
      if (dtype == DType::f32) {
        data_.resize(n * 4);
        std::memcpy(data_.data(), values.data(), n * 4);
      } else {
        data_.resize(n * 2);
        auto* bits = reinterpret_cast<uint16_t*>(data_.data());
        for (size_t i = 0; i < n; ++i) bits[i] = dtype == DType::bf16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
      }
      weight_.data = view(data_, dtype, {out, in});
      break;
    case WeightFormat::fp8_block: {
      const Fp8BlockShape shape{.rows = out, .cols = in};
      const bool f32_scales = scale_format == ScaleFormat::f32;
      data_.resize(n);
      scale_.resize(shape.scale_count() * (f32_scales ? 4 : 1));
      quantize_fp8_block(values, shape, scale_format, data_, scale_);
      weight_.data = view(data_, DType::f8_e4m3, {out, in});
      weight_.scale = view(scale_, f32_scales ? DType::f32 : DType::f8_e8m0, {shape.scale_rows(), shape.scale_cols()});
      break;
    }
    case WeightFormat::mxfp4:
      data_.resize(n / 2);
      scale_.resize(n / kMxfp4Block);
      quantize_mxfp4(values, out, in, data_, scale_);
      weight_.data = view(data_, DType::i8, {out, in / 2});
      weight_.scale = view(scale_, DType::f8_e8m0, {out, in / kMxfp4Block});
      break;
    case WeightFormat::nvfp4:
      data_.resize(n / 2);
      scale_.resize(n / kNvfp4Block);
      weight_.global_scale = quantize_nvfp4(values, out, in, data_, scale_);
      weight_.data = view(data_, DType::u8, {out, in / 2});
      weight_.scale = view(scale_, DType::f8_e4m3, {out, in / kNvfp4Block});
      break;
  }
}

}  // namespace keel
