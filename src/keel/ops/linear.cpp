#include "ops/linear.h"

#include <algorithm>
#include <array>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

namespace keel {
namespace {

// Every code of the small formats, decoded once.
struct Tables {
  std::array<float, 256> e4m3{}, ue8m0{};
  std::array<std::array<float, 2>, 256> e2m1_pair{};  // packed byte -> (even, odd)
  Tables() {
    for (int c = 0; c < 256; ++c) {
      const auto b = static_cast<uint8_t>(c);
      e4m3[c] = e4m3_to_f32(b);
      ue8m0[c] = ue8m0_to_f32(b);
      e2m1_pair[c] = {e2m1_to_f32(e2m1_low(b)), e2m1_to_f32(e2m1_high(b))};
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

constexpr int64_t kFp8Block = 128;

float fp8_block_scale(const Weight& w, int64_t row, int64_t col) {
  const int64_t scale_cols = w.scale.shape[1];
  const int64_t index = (row / kFp8Block) * scale_cols + col / kFp8Block;
  if (w.scale_format == ScaleFormat::f32) return w.scale.as<float>()[index];
  return tables().ue8m0[w.scale.as<uint8_t>()[index]];
}

void decode_fp8_block(const Weight& w, int64_t row, int64_t in, float* out) {
  const uint8_t* codes = w.data.as<uint8_t>() + row * in;
  const auto& e4m3 = tables().e4m3;
  for (int64_t k0 = 0; k0 < in; k0 += kFp8Block) {
    const float scale = fp8_block_scale(w, row, k0);
    const int64_t k1 = std::min(in, k0 + kFp8Block);
    for (int64_t k = k0; k < k1; ++k) out[k] = e4m3[codes[k]] * scale;
  }
}

// Both FP4 formats: byte pairs of e2m1 times the scale of their `block` inputs.
template <typename ScaleOf>
void decode_e2m1(const Weight& w, int64_t row, int64_t in, int block, float* out, ScaleOf scale_of) {
  const uint8_t* packed = w.data.as<uint8_t>() + row * in / 2;
  const uint8_t* scales = w.scale.as<uint8_t>() + row * in / block;
  const auto& pair = tables().e2m1_pair;
  for (int64_t k0 = 0; k0 < in; k0 += block) {
    const float scale = scale_of(scales[k0 / block]);
    for (int64_t k = k0; k < k0 + block; k += 2) {
      const auto& v = pair[packed[k / 2]];
      out[k] = v[0] * scale;
      out[k + 1] = v[1] * scale;
    }
  }
}

// The row's f32 values: a pointer into the checkpoint for f32 weights, else `buffer`.
const float* row_values(const Weight& w, int64_t row, float* buffer) {
  const int64_t in = in_features(w);
  switch (w.format) {
    case WeightFormat::fp8_block:
      decode_fp8_block(w, row, in, buffer);
      return buffer;
    case WeightFormat::mxfp4:
      decode_e2m1(w, row, in, kMxfp4Block, buffer, [](uint8_t s) { return tables().ue8m0[s]; });
      return buffer;
    case WeightFormat::nvfp4: {
      const float global = w.global_scale;
      decode_e2m1(w, row, in, kNvfp4Block, buffer,
                  [global](uint8_t s) { return tables().e4m3[s] * global; });
      return buffer;
    }
    case WeightFormat::bf16:
    case WeightFormat::f32:
      break;
  }
  switch (w.data.dtype) {
    case DType::f32: return w.data.as<float>() + row * in;
    case DType::bf16: {
      const uint16_t* bits = w.data.as<uint16_t>() + row * in;
      for (int64_t k = 0; k < in; ++k) buffer[k] = bf16_to_f32(bits[k]);
      return buffer;
    }
    case DType::f16: {
      const uint16_t* bits = w.data.as<uint16_t>() + row * in;
      for (int64_t k = 0; k < in; ++k) buffer[k] = f16_to_f32(bits[k]);
      return buffer;
    }
    default:
      fail(ErrorCode::unknown_dtype, {.tensor = w.spec->name}, "no CPU matrix kernel for this dtype");
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

RowRange resolve(const Weight& w, RowRange range, ConstRows x, Rows y) {
  const int64_t out = out_features(w);
  if (range.count < 0) range.count = out - range.begin;
  if (range.begin < 0 || range.begin + range.count > out || x.count != y.count) {
    fail(ErrorCode::usage, {.tensor = w.spec->name}, "linear: rows or token counts do not match");
  }
  return range;
}

// Below this much work a parallel region costs more than it saves.
constexpr int64_t kParallelWork = 1 << 15;

}  // namespace

void decode_row(const Weight& w, int64_t row, std::span<float> out) {
  const float* values = row_values(w, row, out.data());
  if (values != out.data()) std::copy(values, values + in_features(w), out.data());
}

void linear(const Weight& w, ConstRows x, Rows y, RowRange range) {
  range = resolve(w, range, x, y);
  const int64_t in = in_features(w);
  const bool parallel = range.count * in * x.count >= kParallelWork;
#pragma omp parallel if (parallel)
  {
    std::vector<float> buffer(static_cast<size_t>(in));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < range.count; ++o) {
      const float* row = row_values(w, range.begin + o, buffer.data());
      for (int64_t t = 0; t < x.count; ++t) y.row(t)[o] = dot(row, x.row(t), in);
    }
  }
}

void linear_reference(const Weight& w, ConstRows x, Rows y, RowRange range) {
  range = resolve(w, range, x, y);
  const int64_t out = out_features(w), in = in_features(w);
  std::vector<float> row(static_cast<size_t>(in));
  const auto bytes = [](const TensorView& v) { return std::span(v.as<uint8_t>(), v.nbytes()); };
  for (int64_t o = range.begin; o < range.begin + range.count; ++o) {
    switch (w.format) {
      case WeightFormat::fp8_block:
        dequantize_fp8_block_row(bytes(w.data), bytes(w.scale), {.rows = out, .cols = in}, w.scale_format, o, row);
        break;
      case WeightFormat::mxfp4: dequantize_mxfp4_row(bytes(w.data), bytes(w.scale), in, o, row); break;
      case WeightFormat::nvfp4:
        dequantize_nvfp4_row(bytes(w.data), bytes(w.scale), w.global_scale, in, o, row);
        break;
      case WeightFormat::bf16:
      case WeightFormat::f32:
        for (int64_t k = 0; k < in; ++k) {
          switch (w.data.dtype) {
            case DType::f32: row[k] = w.data.as<float>()[o * in + k]; break;
            case DType::bf16: row[k] = bf16_to_f32(w.data.as<uint16_t>()[o * in + k]); break;
            case DType::f16: row[k] = f16_to_f32(w.data.as<uint16_t>()[o * in + k]); break;
            default: fail(ErrorCode::unknown_dtype, {.tensor = w.spec->name}, "unsupported dtype");
          }
        }
        break;
    }
    for (int64_t t = 0; t < x.count; ++t) {
      double sum = 0.0;  // the reference accumulates in f64
      for (int64_t k = 0; k < in; ++k) sum += double(row[k]) * x.row(t)[k];
      y.row(t)[o - range.begin] = static_cast<float>(sum);
    }
  }
}

}  // namespace keel
