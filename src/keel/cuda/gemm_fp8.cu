#include "cuda/gemm_fp8.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cuda/check.cuh"
#include "cuda/mma_shares.cuh"
#include "cuda/gemm_mma.h"
#include "cuda/weight_decode.cuh"

namespace keel::cuda {
namespace {

constexpr int kWarps = 8;  // per block
constexpr int kThreads = kWarps * kWarp;
constexpr int kBlockK = 128;  // the FP8 scale block along k, of the weights and of x

// d = A·B for one 16x8x32 tile of e4m3 codes, from a zero accumulator. Lane 4·g + t
// holds, of A, rows g (a0, a2) and g+8 (a1, a3) at k slots 4t..4t+3 (a0, a1) and
// 16+4t..16+4t+3 (a2, a3); of B, token g at the same slots (b0, b1).
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
#else
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();  // never planned here: register_gemm_fp8 lists only archs compiled with the MMA
#endif
}

__device__ __forceinline__ uint32_t word(const uint4& c, int i) {
  return i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
}

__device__ __forceinline__ uint4 load16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// One warp per (token, 128-k group): amax across the warp, the power-of-two scale of
// quantize_fp8_activations (max(amax, 1e-4) / 448 rounded up), each value / scale (exact)
// rounded to the nearest e4m3.
__global__ void quantize_rows(const float* __restrict__ x, int64_t tokens, int64_t in, uint8_t* __restrict__ codes,
                              float* __restrict__ scales) {
  const int64_t groups = in / kBlockK;
  const int64_t unit = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / kWarp;
  if (unit >= tokens * groups) return;  // whole warps
  const int lane = threadIdx.x % kWarp;
  const int64_t at = unit / groups * in + unit % groups * kBlockK + 4 * lane;
  const float4 v = *reinterpret_cast<const float4*>(x + at);
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  for (int o = kWarp / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const uint32_t bits = __float_as_uint(__fdiv_rn(fmaxf(amax, 1e-4f), 448.0f));
  const float s = __uint_as_float(((bits >> 23) + ((bits & 0x7fffffu) != 0 ? 1u : 0u)) << 23);
  const auto code = [s](float a) -> uint32_t {
    return __nv_cvt_float_to_fp8(__fdiv_rn(a, s), __NV_SATFINITE, __NV_E4M3);
  };
  *reinterpret_cast<uint32_t*>(codes + at) = code(v.x) | code(v.y) << 8 | code(v.z) << 16 | code(v.w) << 24;
  if (lane == 0) scales[unit] = s;
}

// Block `blockIdx.x / passes` of rows, tokens [8·C·pass, 8·C·(pass + 1)) for pass
// `blockIdx.x % passes`. A warp computes 16·R rows for those tokens over its share of
// the 128-k blocks (`split` warps share a row tile, as in gemm_mma.cu): per block, two
// steps of 64 k (each lane's 16 codes of a row and of a token, one 16-byte load each),
// two MMAs a step, added in f32; then the block's sum times its weight and token scales
// into the total. Rows past the end read the last row again and tokens past the last
// the last token, never stored. A token's sums depend on the weight's shape only.
template <int R, int C>
__global__ void __launch_bounds__(kThreads, 2)
    w8a8_linear(DeviceWeight w, const uint8_t* __restrict__ xq, const float* __restrict__ xs, float* __restrict__ y,
                int64_t tokens, int split, unsigned passes) {
  const int64_t tok0 = int64_t{blockIdx.x % passes} * (8 * C);
  const int count = static_cast<int>(min(int64_t{8 * C}, tokens - tok0));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int share = warp % split;
  const int64_t row0 = (int64_t{blockIdx.x / passes} * (kWarps / split) + warp / split) * (16 * R);
  const int64_t units = w.in / kBlockK;
  const int64_t u_begin = share * units / split, u_end = (share + 1) * units / split;
  const int groups = min(C, (count + 7) / 8);

  int64_t rows[R][2];
  const uint8_t* src[R][2];
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows[i][h] = min(row0 + 16 * i + g + 8 * h, w.out - 1);
      src[i][h] = static_cast<const uint8_t*>(w.data) + rows[i][h] * w.in + 16 * t;
    }
  }
  // This lane's token of each column group (its B column), and the tokens of its output
  // columns 2t and 2t+1 (whose scales it applies): indices, to spare registers.
  int x_tok[C], even_tok[C], odd_tok[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    x_tok[c] = min(8 * c + g, count - 1);
    even_tok[c] = min(8 * c + 2 * t, count - 1);
    odd_tok[c] = min(8 * c + 2 * t + 1, count - 1);
  }
  xq += tok0 * w.in + 16 * t;
  xs += tok0 * units;

  float acc[R][C][4] = {};
  for (int64_t u = u_begin; u < u_end; ++u) {
    uint4 a[2][R][2];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) a[s][i][h] = load16(src[i][h] + u * kBlockK + 64 * s);
      }
    }
    float sum[R][C][4] = {};
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (c > 0 && c >= groups) break;  // a tile has a token: no test for the first group
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const uint4 b = load16(xq + x_tok[c] * w.in + u * kBlockK + 64 * s);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int i = 0; i < R; ++i) {
            float d[4];
            mma_e4m3(d, word(a[s][i][0], 2 * j), word(a[s][i][1], 2 * j), word(a[s][i][0], 2 * j + 1),
                     word(a[s][i][1], 2 * j + 1), word(b, 2 * j), word(b, 2 * j + 1));
#pragma unroll
            for (int r = 0; r < 4; ++r) sum[i][c][r] = __fadd_rn(sum[i][c][r], d[r]);
          }
        }
      }
    }
    float ws[R][2];
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) ws[i][h] = fp8_block_scale(w, rows[i][h], u * kBlockK);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (c > 0 && c >= groups) break;
      const float even = __ldg(xs + even_tok[c] * units + u), odd = __ldg(xs + odd_tok[c] * units + u);
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          acc[i][c][r] = __fmaf_rn(sum[i][c][r], __fmul_rn(ws[i][r / 2], r % 2 ? odd : even), acc[i][c][r]);
        }
      }
    }
  }

  __shared__ float shares[kWarps][R * C * 4][kWarp];
  add_shares(acc, shares, warp, lane, share, split, [&](int row, int j, float v) {
    const int64_t o = row0 + row;
    if (o < w.out && j < count) y[(tok0 + j) * w.out + o] = v;
  });
}

template <int R, int C>
void launch(const DeviceWeight& w, const uint8_t* xq, const float* xs, float* y, int64_t tokens,
            cudaStream_t stream) {
  const int split = mma_k_split(w);
  const int64_t rows = int64_t{kWarps / split} * 16 * R;
  const int64_t passes = (tokens + 8 * C - 1) / (8 * C);
  const int64_t blocks = (w.out + rows - 1) / rows * passes;
  if (blocks > INT_MAX) throw std::runtime_error("cuda::linear_w8a8: " + std::to_string(tokens) + " tokens in one call");
  w8a8_linear<R, C><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, xq, xs, y, tokens, split,
                                                                            static_cast<unsigned>(passes));
  check(cudaGetLastError(), "linear_w8a8 launch");
}

// Up to 8 tokens, 2 row tiles by 1 token group; more, 1 by 4 (32 tokens a pass; 2 by 2
// spills).
constexpr int kFewTokens = 8;

// The archs the build's list of CUDA archs ("80,90a,120a") compiles real code for, from
// sm_89 on: each entry's number is its compute capability (the "a" / "f" suffixes name
// the same chip).
ArchSet fp8_archs(std::string_view list) {
  ArchSet out;
  while (!list.empty()) {
    const size_t end = std::min(list.find(','), list.size());
    const std::string_view entry = list.substr(0, end);
    list.remove_prefix(std::min(end + 1, list.size()));
    int number = 0;
    for (char ch : entry) {
      if (!std::isdigit(static_cast<unsigned char>(ch))) break;
      number = number * 10 + (ch - '0');
    }
    if (number < 89) continue;
    if (const auto arch = arch_of_capability(number / 10, number % 10)) out = out.with(*arch);
  }
  return out;
}

}  // namespace

bool linear_w8a8_takes(const DeviceWeight& w, const float* x) {
  return w.format == WeightFormat::fp8_block && w.dtype == DType::f8_e4m3 && w.in % kBlockK == 0 && w.in > 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void quantize_activations_fp8(const float* x, int64_t tokens, int64_t in, uint8_t* codes, float* scales,
                              void* stream) {
  if (tokens <= 0 || in <= 0) return;
  if (in % kBlockK != 0) throw std::runtime_error("cuda::quantize_activations_fp8: in must be a multiple of 128");
  const int64_t warps = tokens * (in / kBlockK), blocks = (warps + kWarps - 1) / kWarps;
  if (blocks > INT_MAX) throw std::runtime_error("cuda::quantize_activations_fp8: too many rows");
  quantize_rows<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, tokens, in,
                                                                                                     codes, scales);
  check(cudaGetLastError(), "quantize_activations_fp8 launch");
}

void linear_w8a8(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream_ptr) {
  if (tokens <= 0) return;
  if (!linear_w8a8_takes(w, x)) return linear_mma(w, x, y, tokens, stream_ptr);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  // x's codes and scales in stream-ordered memory: taken from the device's pool and
  // returned to it behind the GEMM, without synchronizing.
  const int64_t code_bytes = (tokens * w.in + 255) / 256 * 256, scale_bytes = tokens * (w.in / kBlockK) * 4;
  void* scratch = nullptr;
  check(cudaMallocAsync(&scratch, static_cast<size_t>(code_bytes + scale_bytes), stream), "cudaMallocAsync");
  auto* codes = static_cast<uint8_t*>(scratch);
  auto* scales = reinterpret_cast<float*>(codes + code_bytes);
  quantize_activations_fp8(x, tokens, w.in, codes, scales, stream);
  if (tokens <= kFewTokens) {
    launch<2, 1>(w, codes, scales, y, tokens, stream);
  } else {
    launch<1, 4>(w, codes, scales, y, tokens, stream);
  }
  check(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
}

void register_gemm_fp8(Registry& registry) {
#ifdef KEEL_CUDA_ARCH_LIST
  const ArchSet archs = fp8_archs(KEEL_CUDA_ARCH_LIST);
#else
  const ArchSet archs;
#endif
  if (archs.empty()) return;  // no FP8 MMA code in this build
  for (const Op op : {Op::dense_gemm, Op::lm_head}) {
    KernelInfo k{.name = "cuda_w8a8_gemm",
                 .op = op,
                 .archs = archs,
                 .formats = {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4, WeightFormat::nvfp4},
                 .activations = {Activation::fp8_e4m3, Activation::f32},
                 .priority = 1,
                 .summary = "W8A8: FP8 weights x per-token 1x128 FP8 activations on FP8 tensor cores "
                            "(mma.sync e4m3, DeepSeek's FP8 GEMM numerics); other weights as cuda_mma_gemm"};
    registry.add(std::move(k.with_entry(&linear_w8a8)));
  }
}

}  // namespace keel::cuda
