#include "ops/linear.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "base/dtype.h"
#include "base/error.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"

namespace keel {
namespace {

// Branch-free conversions of one stored code, so that row loops vectorize. The e4m3
// bits are placed in an f32's exponent/mantissa and rebiased by a power of
// two, which is exact for normal and subnormal codes alike. (NaN codes, which
// quantized weights never hold, come out finite.)
inline float bf16_value(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }
inline float e4m3_value(uint8_t b) {
  return std::bit_cast<float>((uint32_t{b} & 0x80u) << 24 | (uint32_t{b} & 0x7fu) << 20) * 0x1p120f;
}
// e2m1 comes in byte pairs; a table of all 256 pairs decodes one byte per load.
const std::array<std::array<float, 2>, 256>& e2m1_pairs() {
  static const auto table = [] {
    std::array<std::array<float, 2>, 256> t{};
    for (int c = 0; c < 256; ++c) {
      t[c] = {e2m1_to_f32(e2m1_low(static_cast<uint8_t>(c))), e2m1_to_f32(e2m1_high(static_cast<uint8_t>(c)))};
    }
    return t;
  }();
  return table;
}

// Per-block inner loops: the unscaled dot of n stored values with x, and their
// expansion to f32 times a scale. With AVX2 they run 8 lanes at a time (e4m3 by the
// bit placement above, e2m1 by a shift per nibble and an 8-entry permute); the scalar
// loops are the portable path and finish any tail.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 e4m3x8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, rest)), _mm256_set1_ps(0x1p120f));
}
inline __m256 e2m1x8(const uint8_t* packed) {  // 4 bytes, low nibble first
  uint32_t word;
  std::memcpy(&word, packed, sizeof word);
  const __m256i nibble = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
      _mm256_set1_epi32(0xf));
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 0.5f, 1, 1.5f, 2, 3, 4, 6), nibble);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nibble, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 0;
#endif

// A running dot product: 8 lanes with AVX2, reduced once per row.
#if defined(__AVX2__) && defined(__FMA__)
using Acc = __m256;
inline Acc zero_acc() { return _mm256_setzero_ps(); }
inline void add_scaled(Acc& total, Acc part, float scale) {
  total = _mm256_fmadd_ps(part, _mm256_set1_ps(scale), total);
}
inline Acc with_tail(Acc part, float tail) { return _mm256_add_ps(part, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0)); }
inline float reduce(Acc a) { return sum_lanes(a); }
#else
using Acc = float;
inline Acc zero_acc() { return 0.0f; }
inline void add_scaled(Acc& total, Acc part, float scale) { total += part * scale; }
inline Acc with_tail(Acc part, float tail) { return part + tail; }
inline float reduce(Acc a) { return a; }
#endif

// The values from k to n that the 8-lane loop leaves, in one scalar sum.
float tail_e4m3(const uint8_t* v, const float* x, int64_t k, int64_t n) {
  float tail = 0.0f;
  for (; k < n; ++k) tail += e4m3_value(v[k]) * x[k];
  return tail;
}

Acc dot_e4m3(const uint8_t* v, const float* x, int64_t n) {
  int64_t k = 0;
  Acc acc = zero_acc();
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + kLanes <= n; k += kLanes) acc = _mm256_fmadd_ps(e4m3x8(v + k), _mm256_loadu_ps(x + k), acc);
#endif
  return with_tail(acc, tail_e4m3(v, x, k, n));
}

void decode_e4m3(const uint8_t* v, int64_t n, float scale, float* out) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + kLanes <= n; k += kLanes) _mm256_storeu_ps(out + k, _mm256_mul_ps(e4m3x8(v + k), _mm256_set1_ps(scale)));
#endif
  for (; k < n; ++k) out[k] = e4m3_value(v[k]) * scale;
}

float tail_e2m1(const uint8_t* packed, const float* x, int64_t k, int64_t n) {
  float tail = 0.0f;
  if (k == n) return tail;  // whole blocks of 8 (every FP4 block): no table lookup
  const auto& pairs = e2m1_pairs();
  for (; k < n; k += 2) tail += pairs[packed[k / 2]][0] * x[k] + pairs[packed[k / 2]][1] * x[k + 1];
  return tail;
}

// n even; `packed` holds n / 2 bytes.
Acc dot_e2m1(const uint8_t* packed, const float* x, int64_t n) {
  int64_t k = 0;
  Acc acc = zero_acc();
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + kLanes <= n; k += kLanes) acc = _mm256_fmadd_ps(e2m1x8(packed + k / 2), _mm256_loadu_ps(x + k), acc);
#endif
  return with_tail(acc, tail_e2m1(packed, x, k, n));
}

void decode_e2m1(const uint8_t* packed, int64_t n, float scale, float* out) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; k + kLanes <= n; k += kLanes) {
    _mm256_storeu_ps(out + k, _mm256_mul_ps(e2m1x8(packed + k / 2), _mm256_set1_ps(scale)));
  }
#endif
  const auto& pairs = e2m1_pairs();
  for (; k < n; k += 2) {
    out[k] = pairs[packed[k / 2]][0] * scale;
    out[k + 1] = pairs[packed[k / 2]][1] * scale;
  }
}

// dot_e4m3 and dot_e2m1 for several tokens at once: parts[t] is, bit for bit, what the
// one-token form gives for xs[t] + k0 (the same FMAs in the same order, the same tail),
// while each stored value is decoded once for all of them.
constexpr int kManyTokens = 8;

#if defined(__AVX2__) && defined(__FMA__)
// N tokens, a compile-time count so that the accumulators stay in registers.
template <int N, typename Decode8, typename Tail>
void block_dots(const Decode8& decode8, const Tail& tail, const float* const* xs, int64_t k0, int64_t n, Acc* parts) {
  int64_t k = 0;
  Acc acc[N];
  for (int t = 0; t < N; ++t) acc[t] = zero_acc();
  for (; k + kLanes <= n; k += kLanes) {
    const __m256 w = decode8(k);
    for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[t] + k0 + k), acc[t]);
  }
  for (int t = 0; t < N; ++t) parts[t] = with_tail(acc[t], tail(xs[t] + k0, k, n));
}
#endif

// Calls f(std::integral_constant<int, n>{}) for n in 1 .. kManyTokens.
template <typename F>
void with_count(int n, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((n == I + 1 ? f(std::integral_constant<int, I + 1>{}) : void()), ...);
  }(std::make_integer_sequence<int, kManyTokens>{});
}

const std::array<float, 256>& ue8m0_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = ue8m0_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

constexpr int64_t kFp8Block = 128;

float fp8_block_scale(const Weight& w, int64_t row, int64_t col) {
  const int64_t index = (row / kFp8Block) * w.scale.shape[1] + col / kFp8Block;
  if (w.scale_format == ScaleFormat::f32) return w.scale.as<float>()[index];
  return ue8m0_table()[w.scale.as<uint8_t>()[index]];
}

// One row of a weight, in the form each format is stored. `dot` reads the stored
// bytes once (decode steps: one token); `decode` expands to f32 for many tokens.
struct RowReader {
  const Weight& w;
  int64_t in;

  float block_scale(int64_t row, int64_t k0, int block) const {
    const uint8_t s = w.scale.as<uint8_t>()[(row * in + k0) / block];
    return w.format == WeightFormat::mxfp4 ? ue8m0_table()[s] : e4m3_value(s) * w.global_scale;
  }

  // Calls block(k0, k1, scale) over the row's scale blocks (one block for plain floats).
  template <typename Block>
  void for_blocks(int64_t row, Block&& block) const {
    switch (w.format) {
      case WeightFormat::fp8_block:
        for (int64_t k0 = 0; k0 < in; k0 += kFp8Block) block(k0, std::min(in, k0 + kFp8Block), fp8_block_scale(w, row, k0));
        return;
      case WeightFormat::mxfp4:
      case WeightFormat::nvfp4: {
        const int size = w.format == WeightFormat::mxfp4 ? kMxfp4Block : kNvfp4Block;
        for (int64_t k0 = 0; k0 < in; k0 += size) block(k0, k0 + size, block_scale(row, k0, size));
        return;
      }
      case WeightFormat::bf16:
      case WeightFormat::f32:
        block(int64_t{0}, in, 1.0f);
        return;
    }
  }

  float dot(int64_t row, const float* x, float* buffer) const {
    float sum = 0.0f;
    switch (storage()) {
      case Storage::f32: {
        const float* v = w.data.as<float>() + row * in;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < in; ++k) sum += v[k] * x[k];
        return sum;
      }
      case Storage::bf16: {
        const uint16_t* v = w.data.as<uint16_t>() + row * in;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < in; ++k) sum += bf16_value(v[k]) * x[k];
        return sum;
      }
      case Storage::e4m3: {
        const uint8_t* v = w.data.as<uint8_t>() + row * in;
        Acc total = zero_acc();
        for_blocks(row, [&](int64_t k0, int64_t k1, float scale) { add_scaled(total, dot_e4m3(v + k0, x + k0, k1 - k0), scale); });
        return reduce(total);
      }
      case Storage::e2m1: {
        const uint8_t* v = w.data.as<uint8_t>() + row * in / 2;
        Acc total = zero_acc();
        for_blocks(row, [&](int64_t k0, int64_t k1, float scale) {
          add_scaled(total, dot_e2m1(v + k0 / 2, x + k0, k1 - k0), scale);
        });
        return reduce(total);
      }
      case Storage::other: break;
    }
    const float* v = decode(row, buffer);
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < in; ++k) sum += v[k] * x[k];
    return sum;
  }

  // dot() for `tokens` (up to kManyTokens) rows of x at once, each out[t] bit for bit
  // dot()'s: the FP8 and FP4 codes are decoded once per 8 values for all of them.
  void dot_many(int64_t row, const float* const* xs, int tokens, float* out, float* buffer) const {
#if defined(__AVX2__) && defined(__FMA__)
    const Storage kind = storage();
    if (kind == Storage::e4m3 || kind == Storage::e2m1) {
      with_count(tokens, [&](auto count) { dot_fixed<decltype(count)::value>(row, xs, out); });
      return;
    }
#endif
    for (int t = 0; t < tokens; ++t) out[t] = dot(row, xs[t], buffer);
  }

#if defined(__AVX2__) && defined(__FMA__)
  template <int N>
  void dot_fixed(int64_t row, const float* const* xs, float* out) const {
    Acc totals[N], parts[N];
    for (int t = 0; t < N; ++t) totals[t] = zero_acc();
    const auto fold = [&](float scale) {
      for (int t = 0; t < N; ++t) add_scaled(totals[t], parts[t], scale);
    };
    if (storage() == Storage::e4m3) {
      const uint8_t* v = w.data.as<uint8_t>() + row * in;
      for_blocks(row, [&](int64_t k0, int64_t k1, float scale) {
        const uint8_t* b = v + k0;
        block_dots<N>([&](int64_t k) { return e4m3x8(b + k); },
                      [&](const float* x, int64_t k, int64_t n) { return tail_e4m3(b, x, k, n); }, xs, k0, k1 - k0,
                      parts);
        fold(scale);
      });
    } else {
      const uint8_t* v = w.data.as<uint8_t>() + row * in / 2;
      for_blocks(row, [&](int64_t k0, int64_t k1, float scale) {
        const uint8_t* b = v + k0 / 2;
        block_dots<N>([&](int64_t k) { return e2m1x8(b + k / 2); },
                      [&](const float* x, int64_t k, int64_t n) { return tail_e2m1(b, x, k, n); }, xs, k0, k1 - k0,
                      parts);
        fold(scale);
      });
    }
    for (int t = 0; t < N; ++t) out[t] = reduce(totals[t]);
  }
#endif

  // The row as f32: a pointer into the checkpoint for f32 weights, else `buffer`.
  const float* decode(int64_t row, float* out) const {
    switch (storage()) {
      case Storage::f32: return w.data.as<float>() + row * in;
      case Storage::bf16: {
        const uint16_t* v = w.data.as<uint16_t>() + row * in;
        for (int64_t k = 0; k < in; ++k) out[k] = bf16_value(v[k]);
        return out;
      }
      case Storage::e4m3: {
        const uint8_t* v = w.data.as<uint8_t>() + row * in;
        for_blocks(row, [&](int64_t k0, int64_t k1, float scale) { decode_e4m3(v + k0, k1 - k0, scale, out + k0); });
        return out;
      }
      case Storage::e2m1: {
        const uint8_t* v = w.data.as<uint8_t>() + row * in / 2;
        for_blocks(row, [&](int64_t k0, int64_t k1, float scale) { decode_e2m1(v + k0 / 2, k1 - k0, scale, out + k0); });
        return out;
      }
      case Storage::other: break;
    }
    if (w.data.dtype != DType::f16) {
      fail(ErrorCode::unknown_dtype, {.tensor = w.spec->name}, "no CPU matrix kernel for this dtype");
    }
    const uint16_t* v = w.data.as<uint16_t>() + row * in;
    for (int64_t k = 0; k < in; ++k) out[k] = f16_to_f32(v[k]);
    return out;
  }

 private:
  enum class Storage { f32, bf16, e4m3, e2m1, other };
  Storage storage() const {
    switch (w.format) {
      case WeightFormat::fp8_block: return Storage::e4m3;
      case WeightFormat::mxfp4:
      case WeightFormat::nvfp4: return Storage::e2m1;
      case WeightFormat::bf16:
      case WeightFormat::f32: break;
    }
    return w.data.dtype == DType::f32 ? Storage::f32 : w.data.dtype == DType::bf16 ? Storage::bf16 : Storage::other;
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Four tokens against one decoded row: each row load feeds four products (prefill).
void dot4(const float* row, const float* x0, const float* x1, const float* x2, const float* x3, int64_t n,
          float* out) {
  int64_t k = 0;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + kLanes <= n; k += kLanes) {
    const __m256 w = _mm256_loadu_ps(row + k);
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x0 + k), a0);
    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x1 + k), a1);
    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x2 + k), a2);
    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x3 + k), a3);
  }
  s0 = sum_lanes(a0), s1 = sum_lanes(a1), s2 = sum_lanes(a2), s3 = sum_lanes(a3);
#endif
  for (; k < n; ++k) {
    s0 += row[k] * x0[k];
    s1 += row[k] * x1[k];
    s2 += row[k] * x2[k];
    s3 += row[k] * x3[k];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

RowRange resolve(const Weight& w, RowRange range, ConstRows x, Rows y) {
  const int64_t out = out_features(w);
  if (range.count < 0) range.count = out - range.begin;
  if (range.begin < 0 || range.begin + range.count > out || x.count != y.count) {
    fail(ErrorCode::usage, {.tensor = w.spec->name}, "linear: rows or token counts do not match");
  }
  return range;
}

// Up to this many tokens each reads the stored row as a one-token decode does (the row
// stays in cache between them), so a decode step and a speculative verification of up
// to 3 drafts give every token the same bits. More tokens decode the row once to f32.
constexpr int64_t kTokensAsDecode = 4;

// Below this much work a parallel region costs more than it saves.
constexpr int64_t kParallelWork = 1 << 15;

}  // namespace

void decode_row(const Weight& w, int64_t row, std::span<float> out) {
  const float* values = RowReader{w, in_features(w)}.decode(row, out.data());
  if (values != out.data()) std::copy(values, values + in_features(w), out.data());
}

void linear(const Weight& w, ConstRows x, Rows y, RowRange range) {
  range = resolve(w, range, x, y);
  const RowReader reader{w, in_features(w)};
  const int64_t in = reader.in;
  const int64_t whole = x.count;
  const std::span<const int64_t> chunks = x.chunks.empty() ? std::span<const int64_t>(&whole, 1) : x.chunks;
  int64_t total = 0;
  for (const int64_t n : chunks) total += n;
  if (total != x.count) fail(ErrorCode::usage, {.tensor = w.spec->name}, "linear: the chunks do not add up to the rows");
  const bool parallel = range.count * in * x.count >= kParallelWork;
#pragma omp parallel if (parallel)
  {
    std::vector<float> buffer(static_cast<size_t>(in));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < range.count; ++o) {
      const float* row = nullptr;  // decoded once, for the chunks that take the f32 row
      // The tokens of the chunks that run as decode steps, kManyTokens at a time.
      const float* xs[kManyTokens];
      int64_t ts[kManyTokens];
      int pending = 0;
      const auto flush = [&] {
        float out[kManyTokens];
        reader.dot_many(range.begin + o, xs, pending, out, buffer.data());
        for (int i = 0; i < pending; ++i) y.row(ts[i])[o] = out[i];
        pending = 0;
      };
      int64_t first = 0;
      for (const int64_t n : chunks) {
        if (n <= kTokensAsDecode) {  // decode and verification: each token as a decode step
          for (int64_t t = first; t < first + n; ++t) {
            xs[pending] = x.row(t), ts[pending] = t;
            if (++pending == kManyTokens) flush();
          }
        } else {
          if (!row) row = reader.decode(range.begin + o, buffer.data());
          int64_t t = first;
          for (; t + 4 <= first + n; t += 4) {
            float out[4];
            dot4(row, x.row(t), x.row(t + 1), x.row(t + 2), x.row(t + 3), in, out);
            for (int i = 0; i < 4; ++i) y.row(t + i)[o] = out[i];
          }
          for (; t < first + n; ++t) y.row(t)[o] = dot(row, x.row(t), in);
        }
        first += n;
      }
      if (pending) flush();
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

void linear_w8a8_reference(const Weight& w, ConstRows x, Rows y, RowRange range) {
  constexpr int kGroup = 128;
  const int64_t in = in_features(w), groups = (in + kGroup - 1) / kGroup;
  std::vector<float> dense(static_cast<size_t>(x.count * in)), scales(static_cast<size_t>(x.count * groups));
  std::vector<uint8_t> codes(dense.size());
  for (int64_t t = 0; t < x.count; ++t) std::copy_n(x.row(t), in, dense.begin() + t * in);
  quantize_fp8_activations(dense, x.count, in, kGroup, codes, scales);
  for (int64_t i = 0; i < x.count * in; ++i) {
    dense[i] = e4m3_to_f32(codes[i]) * scales[i / in * groups + i % in / kGroup];  // exact: a power-of-two scale
  }
  linear_reference(w, rows_of(std::span<const float>(dense), in), y, range);
}

}  // namespace keel
