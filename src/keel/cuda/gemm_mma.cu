#include "cuda/gemm_mma.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/check.cuh"
#include "cuda/cp_async.cuh"
#include "cuda/fp4_words.h"
#include "cuda/hyper_expand.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma_bf16.cuh"
#include "cuda/mma_shares.cuh"
#include "cuda/moe.h"
#include "cuda/weight_decode.cuh"

namespace keel::cuda {
namespace {

// A warp computes 16·R output rows for 8·C tokens with mma.sync m16n8k16: A is 16
// weight rows by 16 k, B 16 k by 8 tokens, C/D 16 rows by 8 tokens. Lane = 4·g + t
// holds rows g and g+8 of A and token (column) g of B, at the MMA's k slots 2t, 2t+1,
// 2t+8, 2t+9. Which real k a slot stands for is free as long as A and B agree, so each
// lane reads one contiguous 16-byte chunk of rows g and g+8 per step (V values) and the
// matching V floats of its token: the 4 lanes of a group cover 4·V consecutive k, in
// V/4 MMAs. Each format says which of its chunk's values sit at the 4 slots of MMA j
// (x_slots) and builds the A registers from the codes (a_regs).

constexpr int kWarps = 8;  // per block
constexpr int kThreads = kWarps * kWarp;
constexpr int kUnit = 128;  // k granularity of the split across warps: the FP8 scale block

// a · b for two bf16 pairs, one rounding each (exact for the decoders below).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));  // + (-0): the product
  return d;
}

// A weight chunk read once: not kept in L1 (other warps never reread it), fetched
// 256 bytes at a time into L2 (the next lanes' chunks).
__device__ __forceinline__ uint4 load_weights(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// x from global memory through the read-only path, or from a block's staged tile.
template <bool kShared>
__device__ __forceinline__ float4 load_x(const float* p) {
  if constexpr (kShared) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    return __ldg(reinterpret_cast<const float4*>(p));
  }
}

// base + index · size bytes, both 32-bit: one wide multiply-add where 64-bit operands
// would take several (a tile's addresses are computed in its set-up and at every step).
__device__ __forceinline__ const uint8_t* offset(const void* base, uint32_t index, uint32_t size) {
  return static_cast<const uint8_t*>(base) + static_cast<uint64_t>(index) * size;
}

// A 16-bit value in both halves of a word (a bf16 pair of one value).
__device__ __forceinline__ uint32_t twice(uint32_t b) { return b | b << 16; }

__device__ __forceinline__ uint32_t word(const uint4& c, int i) {
  return i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
}

// What decoding one row's chunk of a step multiplies by, as bf16 pairs: `first` for the
// chunk's first 16 values, `second` for the rest (NVFP4's two block scales). MXFP4 in
// `big` steps (a scale past 2^1, never seen in practice) takes a second multiply.
struct Factors {
  uint32_t first = 0, second = 0;
  bool big = false;
};

template <WeightFormat F>
struct Mma;

// bf16: 8 values a chunk, 2 MMAs; MMA j takes values 4j .. 4j+3 in order, as stored.
template <>
struct Mma<WeightFormat::bf16> {
  static constexpr int kValues = 8;
  static constexpr int kBits = 16;  // per value
  __device__ static const uint8_t* scales(const DeviceWeight&, int, int) { return nullptr; }
  __device__ static uint32_t scale_bits(const uint8_t*, int) { return 0; }
  __device__ static Factors factors(uint32_t) { return {}; }
  template <bool>
  __device__ static void a_regs(const uint4& c, int j, const Factors&, uint32_t& low, uint32_t& high) {
    low = word(c, 2 * j), high = word(c, 2 * j + 1);
  }
  template <bool kShared>
  __device__ static void x_slots(const float* p, int j, float4 (&)[2], float v[4]) {
    const float4 q = load_x<kShared>(p + 4 * j);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
};

// FP8 e4m3: 16 values a chunk, 4 MMAs; MMA j takes word j, bytes 0 and 2 at slots 2t
// and 2t+1, bytes 1 and 3 at 2t+8 and 2t+9 (a byte pair 16 bits apart becomes a bf16 pair
// in a few bit operations). The code's bits go where bf16 keeps them (sign at 15,
// exponent and mantissa at 10..4), which reads as the value times 2^-120, subnormals
// included; times 2^120 is exact. The block scale is applied in f32 per 128-k block.
template <>
struct Mma<WeightFormat::fp8_block> {
  static constexpr int kValues = 16;
  static constexpr int kBits = 8;
  // The scale blocks of `row` (fp8_block_scale's, split into the row's part and k's).
  __device__ static const uint8_t* scales(const DeviceWeight& w, int row, int) {
    const auto block_row = static_cast<uint32_t>(row + w.first_row) / 128;
    return offset(w.scale, block_row, static_cast<uint32_t>(w.scale_cols * (w.f32_scales ? 4 : 1)));
  }
  __device__ static float block_scale(const DeviceWeight& w, const uint8_t* scales, int k) {
    const uint32_t block = static_cast<uint32_t>(k) / 128;
    return w.f32_scales ? reinterpret_cast<const float*>(scales)[block] : ue8m0(scales[block]);
  }
  __device__ static uint32_t scale_bits(const uint8_t*, int) { return 0; }
  __device__ static Factors factors(uint32_t) { return {}; }
  template <bool>
  __device__ static void a_regs(const uint4& c, int j, const Factors&, uint32_t& low, uint32_t& high) {
    constexpr uint32_t k2p120 = 0x7b807b80u;  // 2^120, twice
    const uint32_t w = word(c, j);
    low = mul_bf16x2(((w << 8) & 0x80008000u) | ((w << 4) & 0x07f007f0u), k2p120);
    high = mul_bf16x2((w & 0x80008000u) | ((w >> 4) & 0x07f007f0u), k2p120);
  }
  template <bool kShared>
  __device__ static void x_slots(const float* p, int j, float4 (&)[2], float v[4]) {
    const float4 q = load_x<kShared>(p + 4 * j);
    v[0] = q.x, v[1] = q.z, v[2] = q.y, v[3] = q.w;
  }
};

// MXFP4 and NVFP4: 32 values a chunk (one MX block, two NVFP4 blocks), 8 MMAs; MMA j
// takes word j/2, values n and n+4 at slots 2t and 2t+1, n+1 and n+5 at 2t+8 and 2t+9,
// n = 2·(j%2), each pair built from the packed word (fp4_words.h) as bf16 values times
// 2^-126. One multiply makes the codes exact bf16 values times their block scale:
// MX by 2^(e-1) (2^126 · 2^(e-127), a bf16 for e ≤ 128; above, 2^127 then 2^(e-128));
// NVFP4 by e4m3(s)·2^118, which leaves the value times 2^-8, undone with the global
// scale at the end (e2m1 · e4m3 has at most 6 significant bits: exact).
template <WeightFormat F>
struct Fp4Mma {
  static constexpr int kValues = 32;
  static constexpr int kBits = 4;
  // Lane t's scales of `row` from k = 0, and those of its chunk at k: one MX byte, or
  // two NVFP4 bytes (an aligned pair).
  __device__ static const uint8_t* scales(const DeviceWeight& w, int row, int t) {
    const auto in = static_cast<uint32_t>(w.in);
    return F == WeightFormat::mxfp4 ? offset(w.scale, row, in / 32) + t : offset(w.scale, row, in / 16) + 2 * t;
  }
  __device__ static uint32_t scale_bits(const uint8_t* scales, int k) {
    if constexpr (F == WeightFormat::mxfp4) {
      return __ldg(scales + static_cast<uint32_t>(k) / 32);
    } else {
      return __ldg(reinterpret_cast<const uint16_t*>(scales + static_cast<uint32_t>(k) / 16));
    }
  }
  // MX: 2^(e-1) as a bf16 pair, e + 126 in each half's exponent (one multiply-add: the
  // halves do not overlap), or 2^127 where e > 128 (big; `second` then comes from
  // big_second, step_factors).
  __device__ static Factors factors(uint32_t bits) {
    if constexpr (F == WeightFormat::mxfp4) {
      const uint32_t e = bits;
      return {(min(e, 128u) + 126u) * 0x00800080u, 0, e > 128};
    } else {
      const auto bf16 = [](uint32_t s) { return __float_as_uint(e4m3(s) * 0x1p118f) >> 16; };
      return {twice(bf16(bits & 0xffu)), twice(bf16(bits >> 8)), false};
    }
  }
  // MX past e = 128: the second multiply's 2^(e-128) (NaN for e = 255).
  __device__ static uint32_t big_second(uint32_t e) { return twice(e == 255 ? 0x7fc0u : (e - 1) << 7); }
  template <bool kBig>
  __device__ static void a_regs(const uint4& c, int j, const Factors& f, uint32_t& low, uint32_t& high) {
    const uint32_t w = word(c, j / 2);
    const uint32_t scale = F == WeightFormat::nvfp4 && j >= 4 ? f.second : f.first;
    low = mul_bf16x2(j % 2 == 0 ? fp4_pair<0>(w) : fp4_pair<2>(w), scale);
    high = mul_bf16x2(j % 2 == 0 ? fp4_pair<1>(w) : fp4_pair<3>(w), scale);
    if constexpr (F == WeightFormat::mxfp4 && kBig) {
      if (f.big) low = mul_bf16x2(low, f.second), high = mul_bf16x2(high, f.second);
    }
  }
  // MMAs 2i and 2i+1 share the x of word i: loaded for the first, kept in q for the second.
  template <bool kShared>
  __device__ static void x_slots(const float* p, int j, float4 (&q)[2], float v[4]) {
    if (j % 2 == 0) {
      q[0] = load_x<kShared>(p + 4 * j), q[1] = load_x<kShared>(p + 4 * j + 4);
      v[0] = q[0].x, v[1] = q[1].x, v[2] = q[0].y, v[3] = q[1].y;
    } else {
      v[0] = q[0].z, v[1] = q[1].z, v[2] = q[0].w, v[3] = q[1].w;
    }
  }
};
template <>
struct Mma<WeightFormat::mxfp4> : Fp4Mma<WeightFormat::mxfp4> {};
template <>
struct Mma<WeightFormat::nvfp4> : Fp4Mma<WeightFormat::nvfp4> {};

// k per step: 4 lanes of V values.
template <WeightFormat F>
constexpr int kStep = 4 * Mma<F>::kValues;

template <WeightFormat F>
constexpr bool kFp4 = F == WeightFormat::mxfp4 || F == WeightFormat::nvfp4;

// The tokens of one tile, MMA columns 0 .. count-1 (count ≥ 1, at most 8·C): where
// column j's row of x starts and where its finished values go (put). linear_mma's are
// consecutive rows, a group of pairs' the rows its pairs name; linear_mma_expand's
// values are expanded into their token's streams rather than stored.
struct Consecutive {
  const float* x;  // column 0's rows
  float* y;
  int64_t in, out;
  int count;
  __device__ const float* x_row(int j) const { return x + j * in; }
  __device__ float* y_row(int j) const { return y + j * out; }
  __device__ void put(int j, int64_t o, float v) const { y_row(j)[o] = v; }
};
struct Expanding {
  const float* x;  // column 0's rows
  HyperExpandInto into;
  int64_t in, out;
  int64_t token;  // column 0's token in the call: its streams, post and comb
  int count;
  __device__ const float* x_row(int j) const { return x + j * in; }
  __device__ void put(int j, int64_t o, float v) const {
    const int64_t t = token + j;
    const int hc = into.hc;
    const float y = into.pairs ? pairs_sum(into.pairs, into.weights, into.k, t, o, out) + v : v;
    expand_channel(into.post + t * hc, into.comb + t * hc * hc, y, into.streams + t * hc * out + o, hc, out);
  }
};
template <bool kGrouped>
struct Pairs {
  const int32_t* order;  // grouped: the group's pairs
  int32_t first;         // otherwise: the one pair
  const float* x;
  float* y;
  int64_t in, out;
  int per_row, count;
  __device__ int pair(int j) const {
    if constexpr (kGrouped) return __ldg(order + j);
    return first;
  }
  // A 32-bit division (pairs are ints): a 64-bit one is a call of a hundred instructions.
  __device__ const float* x_row(int j) const { return x + int64_t{pair(j) / per_row} * in; }
  __device__ float* y_row(int j) const { return y + int64_t{pair(j)} * out; }
  __device__ void put(int j, int64_t o, float v) const { y_row(j)[o] = v; }
};

// What both tiles share. A lane's weight rows, g and g + 8 of each of a warp's R row
// tiles (rows past the end read the last row again: never stored): where its 16-byte
// chunk of each row starts, and its scale bytes. Rows, k and a row's bytes are 32-bit
// (a weight's rows and k are ints; offset takes the products wide).
template <WeightFormat F, int R>
struct LaneRows {
  using Fmt = Mma<F>;
  const uint8_t *src[R][2], *scales[R][2];
  __device__ LaneRows(const DeviceWeight& w, int row0, int g, int t) {
    const auto row_bytes = static_cast<uint32_t>(w.in * Fmt::kBits / 8);
    const int last = static_cast<int>(w.out) - 1;
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(row0 + 16 * i + g + 8 * h, last);
        src[i][h] = offset(w.data, row, row_bytes) + 16 * t;
        scales[i][h] = Fmt::scales(w, row, t);
      }
    }
  }
  // Where this lane's chunk of the step at k lies past its row's first.
  __device__ static uint32_t chunk_at(int k) { return static_cast<uint32_t>(k) / kStep<F> * 64; }
  // The chunks and scale bits of the step at k.
  __device__ void load(int k, uint4 (&chunk)[R][2], uint32_t (&bits)[R][2]) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        chunk[i][h] = load_weights(src[i][h] + chunk_at(k));
        bits[i][h] = Fmt::scale_bits(scales[i][h], k);
      }
    }
  }
  // The scale bits alone of the step at k (the chunks come through the ring).
  __device__ void load_bits(int k, uint32_t (&bits)[R][2]) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) bits[i][h] = Fmt::scale_bits(scales[i][h], k);
    }
  }
  // The chunks of the step at k into this lane's slots for step s of `ring` (the ring
  // below), as one group of cp.async copies.
  __device__ void copy(int k, uint4* ring, int s) const;
  // FP8: the block scales of the 128-k block at k.
  __device__ void block_scales(const DeviceWeight& w, int k, float (&scale)[R][2]) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) scale[i][h] = Fmt::block_scale(w, scales[i][h], k);
    }
  }
};

// --- One-token tiles: weight chunks through a ring in shared memory ----------------------
//
// A few-token tile's step is short, so its weights must be asked for well before it: a
// lane copies its own chunks of the next steps into its slots of a ring in shared memory
// (cp.async: nothing waits in registers), the first kRing - 1 steps before
// wait_for_inputs, so that a block started early (programmatic dependent launch) loads
// its weights while the kernel before it still runs. Each lane reads back only what it
// copied: its own wait_group orders the two, with no barrier. (tools/probes: chains of
// dependent 32 MiB reads reached 88-91% of the copy bandwidth with weights loaded into
// shared memory before the wait, 2.7 TB/s with loads one step ahead after it.)
constexpr int kRing = 4;  // steps a warp has asked for: the one it computes and 3 ahead

template <int R>
constexpr int64_t kRingBytes = int64_t{kRing} * R * 2 * int64_t{sizeof(uint4)} * kThreads;

// This lane's slot for chunk (i, h) of step s (kRing a power of two).
template <int R>
__device__ __forceinline__ uint4* ring_slot(uint4* ring, int s, int i, int h) {
  static_assert((kRing & (kRing - 1)) == 0);
  return ring + ((s & (kRing - 1)) * (R * 2) + i * 2 + h) * kThreads + threadIdx.x;
}

template <WeightFormat F, int R>
__device__ __forceinline__ void LaneRows<F, R>::copy(int k, uint4* ring, int s) const {
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) cp_async16_l2_256(ring_slot<R>(ring, s, i, h), src[i][h] + chunk_at(k));
  }
  cp_async_commit();
}

// The multipliers of a step's chunks; true if any lane of the warp needs MXFP4's second
// one, which is formed only then.
template <WeightFormat F, int R>
__device__ __forceinline__ bool step_factors(const uint32_t (&bits)[R][2], Factors (&f)[R][2]) {
  bool big = false;
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f[i][h] = Mma<F>::factors(bits[i][h]);
      big |= f[i][h].big;
    }
  }
  if constexpr (F == WeightFormat::mxfp4) {
    if (!__any_sync(0xffffffffu, big)) return false;
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) f[i][h].second = Mma<F>::big_second(bits[i][h]);
    }
    return true;
  }
  return false;
}

// Where a step's x comes from: f32 in global memory, or already split into bf16 hi + lo
// in shared memory (split_x below).
enum class XFrom { global, split };

// One step: every MMA of the chunks `raw` against the first `groups` column groups, x of
// group c from x[c] (this lane's chunk of the step), hi then lo.
template <WeightFormat F, int R, int C, XFrom kX, bool kBig>
__device__ __forceinline__ void mma_step(const uint4 (&raw)[R][2], const Factors (&f)[R][2],
                                         const float* const (&x)[C], int groups, float (&sum)[R][C][4]) {
  using Fmt = Mma<F>;
  float4 xq[C][2];  // x loads an MMA shares with the next (FP4)
#pragma unroll
  for (int j = 0; j < Fmt::kValues / 4; ++j) {
    uint32_t a[R][4];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      Fmt::template a_regs<kBig>(raw[i][0], j, f[i][0], a[i][0], a[i][2]);
      Fmt::template a_regs<kBig>(raw[i][1], j, f[i][1], a[i][1], a[i][3]);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (c > 0 && c >= groups) break;  // a tile has a token: no test for the first group
      Split b0, b1;
      if constexpr (kX == XFrom::split) {
        const uint4 b = *reinterpret_cast<const uint4*>(x[c] + 4 * j);
        b0 = {b.x, b.z}, b1 = {b.y, b.w};
      } else {
        float v[4];
        Fmt::template x_slots<false>(x[c], j, xq[c], v);
        b0 = hi_lo(v[0], v[1]), b1 = hi_lo(v[2], v[3]);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        mma(sum[i][c], a[i], b0.hi, b1.hi);
        mma(sum[i][c], a[i], b0.lo, b1.lo);
      }
    }
  }
}

// FP8: a 128-k block's sums times their rows' scales into acc; the sums restart.
template <int R, int C>
__device__ __forceinline__ void fold_block(float (&sum)[R][C][4], const float (&scale)[R][2], float (&acc)[R][C][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc[i][c][r] = __fmaf_rn(sum[i][c][r], scale[i][r / 2], acc[i][c][r]);
        sum[i][c][r] = 0.0f;
      }
    }
  }
}

// A finished value of row `o` for column j: put unless past the weight or the tile
// (NVFP4 sums are the value times 2^-8, see Fp4Mma).
template <WeightFormat F, typename Columns>
__device__ __forceinline__ void store(const DeviceWeight& w, const Columns& cols, int64_t o, int j, float v) {
  if (o >= w.out || j >= cols.count) return;
  if constexpr (F == WeightFormat::nvfp4) v = __fmul_rn(v, w.global_scale * 256.0f);
  cols.put(j, o, v);
}

// --- x split once, in shared memory ------------------------------------------------------
//
// A split tile's warps each read their own share of k, so none of x's loads is reused in
// the block: read from global memory, each step waited a round trip to L2 for its x
// (ncu: a quarter of a one-token product's stalls), and every warp split its x into
// bf16 hi + lo again (each of the 8 lane groups the same values, for one token). Where
// the tile's columns fit, the block splits all of their x at the start, while the first
// weight chunks load, into shared memory as each MMA takes it: per lane chunk (V values)
// and MMA j, the words hi(v0, v1), hi(v2, v3), lo(v0, v1), lo(v2, v3) of x_slots' order.
// A chunk's V words are followed by 4 of padding so that the 4 lanes of a step read
// distinct banks, and rows (tokens) lie 16 words apart modulo the 32 banks, so that the
// two lane groups of a quarter warp do too.

// The shares of the tile's totals (add_shares), one array per kernel whichever x it reads.
template <int R, int C>
__device__ __forceinline__ float (&tile_shares())[kWarps][R * C * 4][kWarp] {
  __shared__ float shares[kWarps][R * C * 4][kWarp];
  return shares;
}

// The few-token tile's shares (R = 2, C = 1) and the most its split x may take: what a
// launch took without opting in (48 KiB in all) past the shares, before the ring.
constexpr int64_t kSharesBytes = kWarps * 2 * 4 * kWarp * int64_t{sizeof(float)};
constexpr int64_t kSplitXBytes = 48 * 1024 - kSharesBytes;

// The shared memory a few-token launch (R = 2, C = 1) may take per block on this device:
// half a multiprocessor's, so that two blocks fit (one of the kernel after it, started
// early, beside one of this), or where the ring does not fit that way (GPUs with about
// 100 KiB per multiprocessor), all that one block may opt into.
int64_t few_token_shared_budget() {
  static int64_t budget[64] = {};  // per device, read once (a benign race: the same value)
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int64_t& b = budget[device % 64];
  if (b == 0) {
    int per_multiprocessor = 0, per_block = 0;
    check(cudaDeviceGetAttribute(&per_multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
          "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute");
    const int64_t half = std::min<int64_t>(per_block, per_multiprocessor / 2 - 1024);  // 1 KiB a block is the system's
    b = half >= kRingBytes<2> + kSharesBytes + 16 * 1024 ? half : per_block;
  }
  return b;
}

// What a few-token launch's split x may take here (after its ring and shares).
int64_t split_x_cap() { return std::min(kSplitXBytes, few_token_shared_budget() - kRingBytes<2> - kSharesBytes); }

// A few-token kernel's dynamic shared memory may pass 48 KiB: it opts in to its ring and
// the largest split x.
template <auto kKernel>
void allow_ring() {
  allow_shared<kKernel>(static_cast<int>(kRingBytes<2> + split_x_cap()));
}

// Words a row of split x takes: a chunk's V words and 4 of padding, and with several
// rows, up to 16 modulo 32.
template <WeightFormat F>
__host__ __device__ constexpr int64_t split_x_words(int64_t in, int64_t rows) {
  const int64_t words = in / Mma<F>::kValues * (Mma<F>::kValues + 4);
  return rows == 1 ? words : (words + 15) / 32 * 32 + 16;
}

// Shared memory for split x of `count` rows of `in`, or 0 where it would not fit.
template <WeightFormat F>
int64_t split_x_bytes(int64_t in, int64_t count) {
  const int64_t bytes = count * split_x_words<F>(in, count) * int64_t{sizeof(uint32_t)};
  return bytes <= split_x_cap() ? bytes : 0;
}

// The block's threads split the columns' rows of x (their first `in` values; kShared:
// rows in shared memory) into `to`, two MMAs of a lane chunk each at a time (FP4's pair
// of MMAs shares its loads): a one-token FP4 row of 2,048 to 4,096 values is 64 to 128
// whole chunks, and a chunk a thread left most of the block waiting at the barrier
// after the split.
template <WeightFormat F, bool kShared = false, typename Columns>
__device__ __forceinline__ void split_x(const Columns& cols, int in, float* to) {
  using Fmt = Mma<F>;
  constexpr int V = Fmt::kValues, kItems = V / 8;  // items a chunk (a power of two)
  const int chunks = in / V, words = static_cast<int>(split_x_words<F>(in, cols.count));
  const int per_row = chunks * kItems;
  for (int e = threadIdx.x; e < cols.count * per_row; e += kThreads) {
    const int j = cols.count == 1 ? 0 : e / per_row, item = e - j * per_row;
    const int chunk = item / kItems, m = 2 * (item % kItems);
    const float* from = cols.x_row(j) + chunk * V;
    uint4* into = reinterpret_cast<uint4*>(to + j * words + chunk * (V + 4));
    float4 q[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float v[4];
      Fmt::template x_slots<kShared>(from, m + n, q, v);
      const Split b0 = hi_lo(v[0], v[1]), b1 = hi_lo(v[2], v[3]);
      into[m + n] = make_uint4(b0.hi, b1.hi, b0.lo, b1.lo);
    }
  }
}

// The rows of a row block: the split warps' tile's kWarps / split row warps (mma_tile), or
// the staged tile's kWarps (staged_tile), of 16·R rows each.
__host__ __device__ constexpr int64_t rows_per_block(int R, bool staged, int split) {
  return int64_t{staged ? kWarps : kWarps / split} * 16 * R;
}

// Row block `block` holds kWarps / split row warps of 16·R rows each, `split` warps per
// row warp sharing its k in contiguous shares of 128-k units; it computes them for the
// tile's columns. Rows past the end (in the last block) read the last row again, columns
// past the tile's last read that column again (no branches around loads); neither is
// ever stored, and MMA rows and columns do not mix. With `tiles` > 1 the block goes on to
// row blocks block + stride, block + 2·stride, ... (tiles in all), its x split once and,
// with one column group, its ring running on from one row block's steps into the next's.
//
// A row's sum for a token: per warp share, the MMAs in k order (hi, then lo, per MMA),
// FP8 folding each 128-k block's sum times its scale into the total; then the shares
// added in share order. Nothing here depends on R, C, the block's columns, the other
// tokens, where x is read from (kSplitX: split by the block into dynamic shared memory)
// or which block computes the row.
template <WeightFormat F, int R, int C, bool kSplitX, typename Columns>
__device__ __forceinline__ void mma_tile(const DeviceWeight& w, int64_t block, int split, const Columns& cols,
                                         int tiles = 1, int64_t stride = 0) {
  constexpr int V = Mma<F>::kValues, K = kStep<F>;
  constexpr bool kFp8 = F == WeightFormat::fp8_block;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  // split is a power of two (mma_k_split): shifts and masks, not divisions, which in a
  // one-token product's short chain of steps were a tenth of its time.
  const int split_log = __ffs(split) - 1;
  const int share = warp & (split - 1);
  // Rows and k in ints (a weight's rows and k are), so that the set-up and each step's
  // addresses take 32-bit arithmetic (LaneRows).
  const int block_rows = (kWarps >> split_log) * (16 * R), warp_row = (warp >> split_log) * (16 * R);
  const int first_row = static_cast<int>(block * block_rows) + warp_row;
  const int row_stride = static_cast<int>(stride * block_rows);
  const auto row0_of = [&](int n) { return first_row + n * row_stride; };  // row block n's
  const int groups = min(C, (cols.count + 7) / 8);
  const int in = static_cast<int>(w.in);
  const int units = (in + kUnit - 1) / kUnit;
  const int k_begin = (share * units >> split_log) * kUnit;
  const int k_end = min(in, ((share + 1) * units >> split_log) * kUnit);

  // This lane's rows (g and g+8 of each tile) and where its token of each column group
  // starts (its chunk of the step at k = 0).
  LaneRows<F, R> rows(w, row0_of(0), g, t);
  // Dynamic shared memory: the few-token tile's ring (C = 1), then split x (kSplitX).
  constexpr bool kRingOf = C == 1;
  extern __shared__ __align__(16) float dynamic_shared[];
  auto* ring = reinterpret_cast<uint4*>(dynamic_shared);
  float* split_x_rows = dynamic_shared + (kRingOf ? kRingBytes<R> / int64_t{sizeof(float)} : 0);
  const float* xt[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int j = min(8 * c + g, cols.count - 1);
    xt[c] = kSplitX ? split_x_rows + j * split_x_words<F>(in, cols.count) + (V + 4) * t  // padded chunks
                    : cols.x_row(j) + V * t;
  }

  float sum[R][C][4] = {};  // the MMAs' accumulators (FP8: of the current 128-k block)
  float acc[R][C][4] = {};  // FP8: the blocks' sums, each times its scale

  // With one column group the weight chunks come through the ring, kRing - 1 steps ahead
  // (the first before the wait: weights are never written by a kernel), and FP4's scale
  // bits are asked for two steps ahead: a step is short. (The copy that moves them along
  // at the end of a step waits for that step's load, so they have one step to land, not
  // two: docs/perf.md, 2026-12-04.) More groups make a step long enough (and need the
  // registers). The ring counts steps across row blocks: `copying` is the rows of the
  // next step it copies (row block copy_n, step copy_step).
  const int steps = (k_end - k_begin) / K;  // shares are whole 128-k units, K divides 128
  const int all_steps = tiles * steps;
  LaneRows<F, R> copying = rows;
  int copy_n = 0, copy_step = 0;
  const auto copy_next = [&](int q) {  // the ring's step q
    if (q >= all_steps) return cp_async_commit();  // an empty group: one group a step keeps wait_group's count
    copying.copy(k_begin + copy_step * K, ring, q);
    if (++copy_step == steps) {
      copy_step = 0;
      if (++copy_n < tiles) copying = LaneRows<F, R>(w, row0_of(copy_n), g, t);
    }
  };
  uint4 raw[R][2];
  // The scale bits of this step and of the next (one-column tiles, FP4; the other
  // formats have none).
  uint32_t bits[R][2] = {}, next[R][2] = {};
  // The bits of the step `past` steps after (n, step) into to, from that step's row block.
  const auto bits_past = [&](int n, int step, int past, uint32_t(&to)[R][2]) {
    int n2 = n, step2 = step + past;
    while (step2 >= steps) step2 -= steps, ++n2;
    if (n2 >= tiles) return;  // past the last step: never used
    const int k = k_begin + step2 * K;
    if (n2 == n) return rows.load_bits(k, to);
    LaneRows<F, R>(w, row0_of(n2), g, t).load_bits(k, to);
  };
  if constexpr (kRingOf) {
#pragma unroll
    for (int s = 0; s < kRing - 1; ++s) copy_next(s);
    if (steps > 0) {
      rows.load_bits(k_begin, bits);
      bits_past(0, 0, 1, next);
    }
  }
  wait_for_inputs();
  let_next_start();
  if constexpr (kSplitX) {  // while the first chunks load
    split_x<F>(cols, in, split_x_rows);
    __syncthreads();
  }
  float scale[R][2];  // FP8: the block scales of this lane's rows in the current 128-k block
  int q = 0;          // the ring's step
  for (int n = 0; n < tiles; ++n) {
    for (int step = 0; step < steps; ++step, ++q) {
      const int k = k_begin + step * K;
      uint32_t after_next[R][2] = {};
      if constexpr (kRingOf) {
        // Step q + kRing - 1 into the slots step q - 1 read (their values are used: its MMAs ran).
        copy_next(q + kRing - 1);
        if constexpr (kFp4<F>) bits_past(n, step, 2, after_next);
        cp_async_wait<kRing - 1>();  // this step's group is in
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) raw[i][h] = *ring_slot<R>(ring, q, i, h);
        }
      } else {
        rows.load(k, raw, bits);
      }
      Factors f[R][2];
      const bool big = step_factors<F, R>(bits, f);
      if constexpr (kFp8) {
        if ((k & (kUnit - 1)) == 0) rows.block_scales(w, k, scale);
      }
      const float* x[C];
#pragma unroll
      for (int c = 0; c < C; ++c) x[c] = xt[c] + (kSplitX ? k + 4 * static_cast<int>(static_cast<unsigned>(k) / V) : k);
      constexpr XFrom kX = kSplitX ? XFrom::split : XFrom::global;
      if (big) {
        mma_step<F, R, C, kX, true>(raw, f, x, groups, sum);
      } else {
        mma_step<F, R, C, kX, false>(raw, f, x, groups, sum);
      }
      if constexpr (kFp8) {
        if (((k + K) & (kUnit - 1)) == 0 || k + K >= k_end) fold_block(sum, scale, acc);
      }
      if constexpr (kRingOf && kFp4<F>) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) bits[i][h] = next[i][h], next[i][h] = after_next[i][h];
        }
      }
    }

    // The shares' sums, added in share order.
    float(&total)[R][C][4] = kFp8 ? acc : sum;
    const int row0 = row0_of(n);
    add_shares(total, tile_shares<R, C>(), warp, lane, share, split,
               [&](int row, int j, float v) { store<F>(w, cols, row0 + row, j, v); });
    if (n + 1 < tiles) {  // the next row block: its sums from zero, the shares free again
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
          for (int r = 0; r < 4; ++r) total[i][c][r] = 0.0f;
        }
      }
      rows = LaneRows<F, R>(w, row0_of(n + 1), g, t);
      __syncthreads();
    }
  }
}

// --- Many tokens: x staged and split once per block -------------------------------------
//
// With more than 8 tokens a tile is long enough to share its x: the block's warps take 8
// consecutive row tiles (16·R rows each) over the whole of k, and each 128-k unit of the
// tile's x is staged once in shared memory (cp.async) and split into bf16 hi + lo once,
// by the whole block, as each MMA takes it (split_x), for all of them. mma_tile's warps
// each read their own x from L2 (about split·8 times the x traffic), and before the split
// was shared each of the 8 warps split the whole unit again: per MMA and column group,
// two hi + lo splits (about 13 instructions) beside the MMAs' 2·R. Each warp still sums
// as mma_tile's split warps do: a share of k from zero, its MMAs in k order (FP8: the
// 128-k blocks times their scales), then the shares' totals added in share order. So a
// token's row has the same bits from either tile.

// A staged unit of x as split_x's columns: token j's values at j · kUnit.
struct StagedUnit {
  const float* x;
  int count;
  __device__ const float* x_row(int j) const { return x + j * kUnit; }
};

template <WeightFormat F, int R, int C, typename Columns>
__device__ __forceinline__ void staged_tile(const DeviceWeight& w, int64_t block, int split, const Columns& cols) {
  constexpr int V = Mma<F>::kValues, K = kStep<F>;
  constexpr bool kFp8 = F == WeightFormat::fp8_block;
  constexpr int kTokens = 8 * C;
  __shared__ __align__(16) float staged[kTokens * kUnit];                              // unit u's x, f32
  __shared__ __align__(16) float split_unit[kTokens * split_x_words<F>(kUnit, kTokens)];  // the same, split
  __shared__ const float* x_rows[kTokens];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int64_t row0 = (block * kWarps + warp) * (16 * R);
  const int groups = min(C, (cols.count + 7) / 8);
  const int64_t units = (w.in + kUnit - 1) / kUnit;
  wait_for_inputs();
  let_next_start();

  if (threadIdx.x < kTokens) x_rows[threadIdx.x] = cols.x_row(min(static_cast<int>(threadIdx.x), cols.count - 1));
  __syncthreads();
  const auto length = [&](int64_t u) { return static_cast<int>(min(int64_t{kUnit}, w.in - u * kUnit)); };
  const auto stage = [&](int64_t u) {  // unit u's x into `staged`
    const int64_t k0 = u * kUnit;
    const int quads = length(u) / 4;
    for (int e = threadIdx.x; e < kTokens * quads; e += kThreads) {
      const int j = e / quads, f = 4 * (e % quads);
      cp_async16(&staged[j * kUnit + f], x_rows[j] + k0 + f);
    }
    cp_async_commit();
  };

  const LaneRows<F, R> rows(w, static_cast<int>(row0), g, t);
  float sum[R][C][4] = {};    // the MMAs' accumulators (FP8: of the current 128-k block)
  float acc[R][C][4] = {};    // FP8: the share's blocks, each times its scale
  float total[R][C][4] = {};  // the shares so far, added in share order
  int share = 0;
  int64_t share_end = units / split;  // the first unit past this share
  uint4 raw[R][2];
  uint32_t bits[R][2];
  stage(0);
  for (int64_t u = 0; u < units; ++u) {
    // The unit's first weights are asked for before its barriers and split (weights are
    // never written by a kernel): the barriers keep the block's warps in step, so a load
    // issued where it is used would stall all eight at once. (FP4's unit is one step.)
    const int64_t k0 = u * kUnit;
    rows.load(static_cast<int>(k0), raw, bits);
    // Unit u's x is staged, and every warp is past unit u - 1's MMAs: split it.
    cp_async_wait<0>();
    __syncthreads();
    const int in_unit = length(u), words = static_cast<int>(split_x_words<F>(in_unit, kTokens));
    split_x<F, true>(StagedUnit{staged, kTokens}, in_unit, split_unit);
    __syncthreads();  // split, and `staged` free: the next unit's x loads while this one's MMAs run
    if (u + 1 < units) stage(u + 1);
    const int64_t k1 = k0 + in_unit;
    float scale[R][2];
    if constexpr (kFp8) rows.block_scales(w, static_cast<int>(k0), scale);
    for (int64_t k = k0; k < k1; k += K) {
      if (k > k0) rows.load(static_cast<int>(k), raw, bits);
      Factors f[R][2];
      const bool big = step_factors<F, R>(bits, f);
      // This lane's chunk of the step (the unit's chunk (k - k0) / V + t, V words and 4 of
      // padding each) in each column group's rows.
      const int chunk = static_cast<int>(k - k0) / V + t;
      const float* x[C];
#pragma unroll
      for (int c = 0; c < C; ++c) x[c] = split_unit + (8 * c + g) * words + chunk * (V + 4);
      if (big) {
        mma_step<F, R, C, XFrom::split, true>(raw, f, x, groups, sum);
      } else {
        mma_step<F, R, C, XFrom::split, false>(raw, f, x, groups, sum);
      }
    }
    if constexpr (kFp8) fold_block(sum, scale, acc);
    if (u + 1 == share_end) {  // the share is done: into the total, in share order
      float(&part)[R][C][4] = kFp8 ? acc : sum;
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            total[i][c][r] = share == 0 ? part[i][c][r] : __fadd_rn(total[i][c][r], part[i][c][r]);
            part[i][c][r] = 0.0f;
          }
        }
      }
      ++share;
      share_end = (share + 1) * units / split;
    }
  }

#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) store<F>(w, cols, row0 + 16 * i + g + 8 * (r / 2), 8 * c + 2 * t + r % 2, total[i][c][r]);
    }
  }
}

// Block `blockIdx.x / passes` of rows, tokens [8·C·pass, 8·C·(pass + 1)) for pass
// `blockIdx.x % passes`, by the split warps' tile (kSplitX: x split in dynamic shared
// memory) or (kStaged) the staged one; into y (Out = float*) or expanded into an mHC
// site's streams (Out = HyperExpandInto).
template <WeightFormat F, int R, int C, bool kStaged = false, bool kSplitX = false, typename Out = float*>
__global__ void __launch_bounds__(kThreads, 2)
    mma_linear(DeviceWeight w, const float* __restrict__ x, const Out out, int64_t tokens, int split,
               unsigned passes) {
  const int64_t tok0 = int64_t{blockIdx.x % passes} * (8 * C);
  const int count = static_cast<int>(min(int64_t{8 * C}, tokens - tok0));
  const auto run = [&](const auto& cols) {
    if constexpr (kStaged) {
      staged_tile<F, R, C>(w, blockIdx.x / passes, split, cols);
    } else {
      mma_tile<F, R, C, kSplitX>(w, blockIdx.x / passes, split, cols);
    }
  };
  if constexpr (std::is_same_v<Out, float*>) {
    run(Consecutive{x + tok0 * w.in, out + tok0 * w.out, w.in, w.out, count});
  } else {
    run(Expanding{x + tok0 * w.in, out, w.in, w.out, tok0, count});
  }
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z): rows block blockIdx.x for the pairs of
// group blockIdx.y, a tile of one expert's pairs, its weight read once for all of them;
// blockIdx.z = 1 takes the second table into the second output instead (an expert's
// gate and up projections, same shape and x, in one launch).
// Blocks past the groups group_pairs made do nothing; a group of unrouted pairs or of
// an expert without data (another rank's) writes zeros. Ungrouped, group p is pair p
// alone. Each expert's shape and encoding are like's; its pointers, first row and
// global scale come from its table entry. kStaged: the staged tile (grouped only);
// kSplitX: the split warps' tile with x split in dynamic shared memory.
//
// The experts come from the routing or the call's inputs, the groups from group_pairs:
// a block waits for the kernel before it first, unless `settled` (ExpertIds::settled,
// ungrouped): then it reads its expert from L2 (its writer has finished, but this block
// may have started before the kernel before it did: nothing older than L2 is trusted)
// and mma_tile asks for the expert's first weights before it waits.
template <WeightFormat F, int R, int C, bool kGrouped, bool kStaged = false, bool kSplitX = false>
__global__ void __launch_bounds__(kThreads, 2)
    mma_pairs(const DeviceWeight* __restrict__ table, const DeviceWeight* __restrict__ second_table, DeviceWeight like,
              const int32_t* __restrict__ experts, const int32_t* __restrict__ order,
              const PairGroup* __restrict__ groups, const int32_t* __restrict__ group_count, int per_row,
              const float* __restrict__ x, float* __restrict__ y, float* __restrict__ second_y, int split,
              bool settled) {
  const bool early = !kGrouped && settled;
  if (!early) {
    wait_for_inputs();
    let_next_start();
  }
  if (blockIdx.z == 1) table = second_table, y = second_y;
  PairGroup group;
  if constexpr (kGrouped) {
    if (static_cast<int>(blockIdx.y) >= *group_count) return;
    group = groups[blockIdx.y];
  } else {
    group = {early ? __ldcg(experts + blockIdx.y) : experts[blockIdx.y], static_cast<int32_t>(blockIdx.y), 1};
  }
  const Pairs<kGrouped> cols{kGrouped ? order + group.first : nullptr, group.first, x, y, like.in, like.out, per_row,
                            group.count};
  // Row blocks blockIdx.x, blockIdx.x + gridDim.x, ...: launch_pairs launches fewer
  // blocks than row blocks for one token's pairs (the one-token tile, ungrouped).
  constexpr bool kFitted = C == 1 && !kGrouped;
  const int64_t rows = rows_per_block(R, kStaged, split), row_blocks = (like.out + rows - 1) / rows;
  const int tiles = static_cast<int>((row_blocks - blockIdx.x + gridDim.x - 1) / gridDim.x);
  const DeviceWeight* e = group.expert < 0 ? nullptr : table + group.expert;
  if (e == nullptr || e->data == nullptr) {
    wait_for_inputs();  // before y is written (already past it unless early)
    let_next_start();
    for (int64_t b = blockIdx.x; b < row_blocks; b += gridDim.x) {
      const int64_t first = b * rows;
      const int n = static_cast<int>(min(rows, like.out - first));
      for (int i = threadIdx.x; i < group.count * n; i += kThreads) cols.y_row(i / n)[first + i % n] = 0.0f;
    }
    return;
  }
  DeviceWeight w = like;
  w.data = e->data, w.scale = e->scale, w.first_row = e->first_row, w.global_scale = e->global_scale;
  if constexpr (kStaged) {
    staged_tile<F, R, C>(w, blockIdx.x, split, cols);
  } else {
    mma_tile<F, R, C, kSplitX>(w, blockIdx.x, split, cols, kFitted ? tiles : 1, gridDim.x);
  }
}

// A warp's tile: up to 8 tokens, 2 row tiles (32 rows) by 1 column group, so x's
// conversion serves two tiles and registers leave room for the next step's loads (1 row
// tile where 2 would leave the GPU short of blocks, see one_row_tile). More
// tokens: 2 row tiles by 2 column groups (16 tokens per pass), each decoded chunk used
// twice and each converted x twice; FP4 (32-value chunks, twice the registers) takes 1
// row tile by 4 groups instead, what fits in 128 registers without spilling.
constexpr int kFewTokens = 8;

// Whether a staged launch of `blocks` blocks (8 row tiles each) still fills the GPU
// several times over; otherwise the split warps' tile, 8/split times the blocks, runs
// instead (a batch of 64 tokens leaves a staged wo_b 64 blocks). Either gives the same
// bits; set_mma_tiles overrides the choice.
std::atomic<MmaTiles> tiles_in_use{MmaTiles::automatic};

int multiprocessors() {
  static int count[64] = {};  // per device, read once (a benign race: the same value)
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int& n = count[device % 64];
  if (n == 0) check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return n;
}

bool staged_fills_gpu(int64_t blocks) {
  if (tiles_in_use != MmaTiles::automatic) return tiles_in_use == MmaTiles::staged;
  return blocks >= 4 * int64_t{multiprocessors()};
}

// Row blocks per block for a one-token pairs launch of `launched` blocks (row blocks x
// pairs x tables): enough that its blocks all fit on the GPU at once. A block that goes
// on to further row blocks keeps its ring streaming and its x split (mma_tile), where a
// block of a second wave would wait for its expert, split its x and wait for its first
// weights again (ncu: half of such a block's stalls).
std::atomic<int> pairs_row_blocks{0};  // set_pairs_row_blocks

template <auto kKernel>
int64_t row_blocks_per_block(int64_t launched, size_t shared) {
  if (const int forced = pairs_row_blocks; forced > 0) return forced;
  int per_multiprocessor = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kKernel, kThreads, shared),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int64_t fit = std::max<int64_t>(1, int64_t{per_multiprocessor} * multiprocessors());
  return (launched + fit - 1) / fit;
}

template <WeightFormat F, int R, int C, typename Out>
void launch(const DeviceWeight& w, const float* x, Out y, int64_t tokens, cudaStream_t stream) {
  const int split = mma_k_split(w);
  const int64_t passes = (tokens + 8 * C - 1) / (8 * C);
  const int64_t staged_rows = rows_per_block(R, true, split);
  // Several column groups share x through the block (staged_tile) where that fills the GPU.
  const bool staged = C > 1 && staged_fills_gpu((w.out + staged_rows - 1) / staged_rows * passes);
  const int64_t rows = rows_per_block(R, staged, split);
  const int64_t blocks = (w.out + rows - 1) / rows * passes;
  if (blocks > INT_MAX) throw std::runtime_error("cuda::linear_mma: " + std::to_string(tokens) + " tokens in one call");
  if constexpr (C > 1) {
    if (staged) {
      return overlapped_launch("linear_mma launch", mma_linear<F, R, C, true, false, Out>,
                               static_cast<unsigned>(blocks), kThreads, 0, stream, w, x, y, tokens, split,
                               static_cast<unsigned>(passes));
    }
  } else if (const int64_t x_bytes = split_x_bytes<F>(w.in, tokens); x_bytes > 0) {  // tokens ≤ 8
    allow_ring<mma_linear<F, R, C, false, true, Out>>();
    return overlapped_launch("linear_mma launch", mma_linear<F, R, C, false, true, Out>,
                             static_cast<unsigned>(blocks), kThreads, kRingBytes<R> + x_bytes, stream, w, x, y, tokens,
                             split, static_cast<unsigned>(passes));
  }
  if constexpr (C == 1) allow_ring<mma_linear<F, R, C, false, false, Out>>();
  overlapped_launch("linear_mma launch", mma_linear<F, R, C, false, false, Out>, static_cast<unsigned>(blocks),
                    kThreads, C == 1 ? kRingBytes<R> : 0, stream, w, x, y, tokens, split,
                    static_cast<unsigned>(passes));
}

// Up to 8 tokens, a warp takes 2 row tiles, or 1 where 2 would leave each multiprocessor
// at most one block (`blocks` of them): twice the blocks, each a shorter chain of steps,
// the same bits (mma_tile).
std::atomic<int> few_token_row_tiles{0};  // set_few_token_row_tiles

bool one_row_tile(int64_t blocks) {
  if (const int forced = few_token_row_tiles; forced > 0) return forced == 1;
  return blocks <= multiprocessors();
}

// The expand's tokens from `first` on: its pointers moved to that token.
HyperExpandInto from_token(const HyperExpandInto& into, int64_t first, int64_t out) {
  HyperExpandInto moved = into;
  moved.post += first * into.hc;
  moved.comb += first * into.hc * into.hc;
  moved.streams += first * into.hc * out;
  if (into.pairs) moved.pairs += first * into.k * out, moved.weights += first * into.k;
  return moved;
}

template <WeightFormat F, typename Out>
void launch(const DeviceWeight& w, const float* x, Out y, int64_t tokens, cudaStream_t stream) {
  constexpr bool kExpanding = std::is_same_v<Out, HyperExpandInto>;
  if (tokens <= kFewTokens) {
    const int64_t rows = rows_per_block(2, false, mma_k_split(w));
    if (one_row_tile((w.out + rows - 1) / rows)) {
      launch<F, 1, 1>(w, x, y, tokens, stream);
    } else {
      launch<F, 2, 1>(w, x, y, tokens, stream);
    }
  } else if constexpr (kExpanding) {
    // The expanding tiles exist for decode steps (the model fuses calls of up to 8 rows):
    // more tokens go 8 at a time through the few-token tile, which gives every token the
    // bits of any other tile, rather than instantiating the many-token tiles twice more.
    for (int64_t first = 0; first < tokens; first += kFewTokens) {
      launch<F>(w, x + first * w.in, from_token(y, first, w.out), std::min<int64_t>(kFewTokens, tokens - first), stream);
    }
  } else {
    launch<F, kFp4<F> ? 1 : 2, kFp4<F> ? 4 : 2>(w, x, y, tokens, stream);
  }
}

// linear_mma's launch for the weight's format, into y or expanded (Out as mma_linear's).
template <typename Out>
void launch_any(const DeviceWeight& w, const float* x, Out y, int64_t tokens, cudaStream_t stream) {
  switch (w.format) {
    case WeightFormat::bf16: return launch<WeightFormat::bf16>(w, x, y, tokens, stream);
    case WeightFormat::fp8_block: return launch<WeightFormat::fp8_block>(w, x, y, tokens, stream);
    case WeightFormat::mxfp4: return launch<WeightFormat::mxfp4>(w, x, y, tokens, stream);
    case WeightFormat::nvfp4: return launch<WeightFormat::nvfp4>(w, x, y, tokens, stream);
    default: break;
  }
}

// --- Several weights over one x, one launch ------------------------------------------------
//
// A one-token product of a small weight is a few dozen blocks, each a chain of dependent
// steps: the GPU stays mostly idle, and the launches follow one another. The products
// of a group (one x, up to 8 tokens) run as one launch instead, its blocks split among
// them in order; each block runs mma_linear's tile for its weight with that weight's
// split, so every product keeps the bits it has alone.

constexpr int kMaxGroup = 8;
struct GroupLaunch {
  DeviceWeight w[kMaxGroup];
  float* y[kMaxGroup];
  int split[kMaxGroup];
  int first_block[kMaxGroup + 1];  // product j's blocks: [first_block[j], first_block[j + 1])
  int count = 0;
};

// R row tiles per warp; kSplitX: x split in dynamic shared memory (where every product's fits).
template <int R, bool kSplitX>
__global__ void __launch_bounds__(kThreads, 2)
    mma_group(const __grid_constant__ GroupLaunch g, const float* __restrict__ x, int tokens) {
  int j = 0;
  while (j + 1 < g.count && static_cast<int>(blockIdx.x) >= g.first_block[j + 1]) ++j;
  const DeviceWeight& w = g.w[j];
  const Consecutive cols{x, g.y[j], w.in, w.out, tokens};
  const int64_t block = blockIdx.x - g.first_block[j];
  switch (w.format) {
    case WeightFormat::bf16: return mma_tile<WeightFormat::bf16, R, 1, kSplitX>(w, block, g.split[j], cols);
    case WeightFormat::fp8_block: return mma_tile<WeightFormat::fp8_block, R, 1, kSplitX>(w, block, g.split[j], cols);
    default: return wait_for_inputs();  // never grouped (group_takes); waits as every overlapped kernel does
  }
}

// The group kernel holds the dense formats' tiles (bf16, FP8): with the FP4 ones too it
// would spill registers.
bool group_takes(const DeviceWeight& w, const float* x) {
  return (w.format == WeightFormat::bf16 || w.format == WeightFormat::fp8_block) && linear_mma_takes(w, x);
}

// The shared memory a grouped product's x takes (0: it does not fit).
int64_t group_x_bytes(const DeviceWeight& w, int64_t tokens) {
  return w.format == WeightFormat::bf16 ? split_x_bytes<WeightFormat::bf16>(w.in, tokens)
                                        : split_x_bytes<WeightFormat::fp8_block>(w.in, tokens);
}

// The group's blocks for R row tiles per warp, product by product.
int place_blocks(GroupLaunch& g, int R) {
  int blocks = 0;
  for (int j = 0; j < g.count; ++j) {
    const int64_t rows = rows_per_block(R, false, g.split[j]);
    g.first_block[j] = blocks;
    blocks += static_cast<int>((g.w[j].out + rows - 1) / rows);
  }
  return g.first_block[g.count] = blocks;
}

template <int R>
void launch_group(const GroupLaunch& g, int64_t x_bytes, const float* x, int64_t tokens, cudaStream_t stream) {
  allow_ring<mma_group<R, true>>();
  allow_ring<mma_group<R, false>>();
  const auto kernel = x_bytes > 0 ? mma_group<R, true> : mma_group<R, false>;
  overlapped_launch("linear_mma_group launch", kernel, static_cast<unsigned>(g.first_block[g.count]), kThreads,
                    kRingBytes<R> + x_bytes, stream, g, x, static_cast<int>(tokens));
}

void launch_group(GroupLaunch& g, const float* x, int64_t tokens, cudaStream_t stream) {
  if (g.count == 0) return;
  int64_t x_bytes = 0;
  for (int j = 0; j < g.count; ++j) {
    const int64_t bytes = group_x_bytes(g.w[j], tokens);
    if (bytes == 0) {
      x_bytes = 0;
      break;
    }
    x_bytes = std::max(x_bytes, bytes);
  }
  if (one_row_tile(place_blocks(g, 2))) {
    place_blocks(g, 1);
    launch_group<1>(g, x_bytes, x, tokens, stream);
  } else {
    launch_group<2>(g, x_bytes, x, tokens, stream);
  }
  g.count = 0;
}

// linear_pairs_mma's scratch: the pair indices expert by expert, the groups, their count.
constexpr int64_t kGroupInts = sizeof(PairGroup) / sizeof(int32_t);
static_assert(sizeof(PairGroup) == kGroupInts * sizeof(int32_t) && alignof(PairGroup) <= alignof(int32_t));

// Up to this many pairs go ungrouped, each its own group: they could share few reads
// (one token's experts are distinct), and grouping costs a launch.
constexpr int64_t kUngrouped = 8;

// One or two tables of experts over the same pairs, each into its output (the second
// null when one).
struct Tables {
  const DeviceWeight *first, *second;
  float *y, *second_y;
};

// The pairs grouped by expert in tiles of a kernel's 8·C columns (or not at all), then
// a block per (row block, group). The grid's second dimension is the most groups there
// can be: one per pair, and besides the full tiles at most one partial tile per expert
// (and one of the unrouted).
template <WeightFormat F, int R, int C, bool kGrouped>
void launch_pairs(const Tables& t, int n_table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
                  int per_row, const float* x, int32_t* scratch, bool settled, cudaStream_t stream) {
  constexpr int kTile = 8 * C;
  int32_t *order = nullptr, *count = nullptr;
  PairGroup* groups = nullptr;
  if constexpr (kGrouped) {
    order = scratch, groups = reinterpret_cast<PairGroup*>(scratch + pairs), count = scratch + (1 + kGroupInts) * pairs;
    group_pairs(experts, pairs, n_table, kTile, order, groups, count, stream);
  }
  const int split = mma_k_split(like);
  const int64_t most = kGrouped ? std::min(pairs, std::min(pairs, int64_t{n_table} + 1) + pairs / kTile) : pairs;
  // Several column groups share x through the block (staged_tile) where the groups'
  // full tiles alone fill the GPU.
  const int64_t staged_rows = rows_per_block(R, true, split);
  const bool staged = C > 1 && staged_fills_gpu((like.out + staged_rows - 1) / staged_rows * (pairs / kTile));
  const int64_t rows = rows_per_block(R, staged, split), blocks = (like.out + rows - 1) / rows;
  if (most > 65535 || blocks > INT_MAX) {
    throw std::runtime_error("cuda::linear_pairs_mma: " + std::to_string(pairs) + " pairs in one call");
  }
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(most), t.second ? 2 : 1);
  // One token's pairs (ungrouped, the one-token tile): as many blocks as fit at once, each
  // over several row blocks (mma_pairs' kFitted).
  const auto fitted = [&]<auto kKernel>(size_t shared) {
    allow_ring<kKernel>();
    if (kGrouped) return grid;
    const int64_t per_block = row_blocks_per_block<kKernel>(blocks * grid.y * grid.z, shared);
    return dim3(static_cast<unsigned>((blocks + per_block - 1) / per_block), grid.y, grid.z);
  };
  if constexpr (kGrouped && C > 1) {
    if (staged) {
      return overlapped_launch("linear_pairs_mma launch", mma_pairs<F, R, C, true, true>, grid, kThreads, 0, stream,
                               t.first, t.second, like, experts, order, groups, count, per_row, x, t.y, t.second_y,
                               split, settled);
    }
  } else if (const int64_t x_bytes = split_x_bytes<F>(like.in, kGrouped ? std::min<int64_t>(pairs, kTile) : 1);
             x_bytes > 0) {  // a group's pairs (at most 8, one ungrouped), each with its row of x
    constexpr auto kernel = mma_pairs<F, R, C, kGrouped, false, true>;
    const size_t shared = kRingBytes<R> + x_bytes;
    return overlapped_launch("linear_pairs_mma launch", kernel, fitted.template operator()<kernel>(shared), kThreads,
                             shared, stream, t.first, t.second, like, experts, order, groups, count, per_row, x, t.y,
                             t.second_y, split, settled);
  }
  if constexpr (C == 1) {
    constexpr auto kernel = mma_pairs<F, R, C, kGrouped>;
    return overlapped_launch("linear_pairs_mma launch", kernel, fitted.template operator()<kernel>(kRingBytes<R>),
                             kThreads, kRingBytes<R>, stream, t.first, t.second, like, experts, order, groups, count,
                             per_row, x, t.y, t.second_y, split, settled);
  }
  overlapped_launch("linear_pairs_mma launch", mma_pairs<F, R, C, kGrouped>, grid, kThreads, 0, stream, t.first,
                    t.second, like, experts, order, groups, count, per_row, x, t.y, t.second_y, split, settled);
}

// The tile as linear_mma picks it by tokens per call, here by pairs per table entry on
// average: batched decode's few take 8 columns, prefill's many the larger tile.
template <WeightFormat F>
void launch_pairs(const Tables& t, int n_table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
                  int per_row, const float* x, int32_t* scratch, bool settled, cudaStream_t stream) {
  if (pairs <= kUngrouped) {
    launch_pairs<F, 2, 1, false>(t, n_table, like, experts, pairs, per_row, x, scratch, settled, stream);
  } else if (pairs <= int64_t{kFewTokens} * n_table) {
    launch_pairs<F, 2, 1, true>(t, n_table, like, experts, pairs, per_row, x, scratch, settled, stream);
  } else {
    launch_pairs<F, kFp4<F> ? 1 : 2, kFp4<F> ? 4 : 2, true>(t, n_table, like, experts, pairs, per_row, x, scratch,
                                                           settled, stream);
  }
}

// The k a step covers, or 0 for a weight the tensor-core kernel does not take.
int step_of(const DeviceWeight& w) {
  switch (w.format) {
    case WeightFormat::bf16: return w.dtype == DType::bf16 ? kStep<WeightFormat::bf16> : 0;
    case WeightFormat::fp8_block: return w.dtype == DType::f8_e4m3 ? kStep<WeightFormat::fp8_block> : 0;
    case WeightFormat::mxfp4: return kStep<WeightFormat::mxfp4>;
    case WeightFormat::nvfp4: return kStep<WeightFormat::nvfp4>;
    default: return 0;
  }
}

}  // namespace

void set_mma_tiles(MmaTiles tiles) { tiles_in_use = tiles; }
void set_pairs_row_blocks(int per_block) { pairs_row_blocks = per_block; }
void set_few_token_row_tiles(int tiles) { few_token_row_tiles = tiles; }

int mma_k_split(const DeviceWeight& w) {  // a power of two: mma_tile and add_shares rely on it
  const int64_t tiles = (w.out + 31) / 32, units = (w.in + kUnit - 1) / kUnit;
  int split = 1;
  while (split < kWarps && tiles * split < 2048 && units >= 4 * split) split *= 2;
  return split;
}

bool linear_mma_takes(const DeviceWeight& w, const float* x) {
  const int step = step_of(w);
  return step > 0 && w.in % step == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void linear_mma(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream_ptr) {
  if (tokens <= 0) return;
  if (!linear_mma_takes(w, x)) return linear(w, x, y, tokens, stream_ptr);  // small test models' shapes
  launch_any(w, x, y, tokens, static_cast<cudaStream_t>(stream_ptr));
}

void linear_mma_expand(const DeviceWeight& w, const float* x, int64_t tokens, const HyperExpandInto& into,
                       void* stream_ptr) {
  if (tokens <= 0) return;
  if (!linear_mma_takes(w, x) || into.hc < 1 || into.hc > kMaxHyperStreams || (into.pairs && into.k < 0)) {
    throw std::runtime_error("cuda::linear_mma_expand: a product linear_mma_takes, 1.." +
                             std::to_string(kMaxHyperStreams) + " streams and k >= 0, got hc " +
                             std::to_string(into.hc) + ", k " + std::to_string(into.k));
  }
  launch_any(w, x, into, tokens, static_cast<cudaStream_t>(stream_ptr));
}

void linear_mma_group(std::span<const GemmProduct> products, const float* x, int64_t tokens, void* stream_ptr) {
  if (tokens <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  GroupLaunch g;
  for (const GemmProduct& p : products) {
    if (tokens > kFewTokens || !group_takes(*p.w, x)) {  // alone, as linear_mma takes it
      linear_mma(*p.w, x, p.y, tokens, stream_ptr);
      continue;
    }
    if (g.count == kMaxGroup) launch_group(g, x, tokens, stream);
    g.w[g.count] = *p.w, g.y[g.count] = p.y, g.split[g.count] = mma_k_split(*p.w);
    ++g.count;
  }
  launch_group(g, x, tokens, stream);
}

int64_t linear_pairs_scratch(int64_t pairs, int /*n_table*/) {
  return pairs <= 0 ? 0 : (1 + kGroupInts) * pairs + 1;  // order, groups (at most one per pair), count
}

namespace {

bool pairs_take(const DeviceWeight& like, const float* x, int n_table) {
  return linear_mma_takes(like, x) && n_table >= 1 && n_table <= kMaxGroupedExperts;
}

void run_pairs(const Tables& t, int n_table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
               int per_row, const float* x, int32_t* scratch, void* stream_ptr, ExpertIds ids) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const bool settled = ids == ExpertIds::settled;
  const auto run = [&]<WeightFormat F>() {
    launch_pairs<F>(t, n_table, like, experts, pairs, per_row, x, scratch, settled, stream);
  };
  switch (like.format) {
    case WeightFormat::bf16: return run.template operator()<WeightFormat::bf16>();
    case WeightFormat::fp8_block: return run.template operator()<WeightFormat::fp8_block>();
    case WeightFormat::mxfp4: return run.template operator()<WeightFormat::mxfp4>();
    case WeightFormat::nvfp4: return run.template operator()<WeightFormat::nvfp4>();
    default: break;
  }
}

}  // namespace

void linear_pairs_mma(const DeviceWeight* table, int n_table, const DeviceWeight& like, const int32_t* experts,
                      int64_t pairs, int per_row, const float* x, float* y, int32_t* scratch, void* stream_ptr,
                      ExpertIds ids) {
  if (pairs <= 0) return;
  if (!pairs_take(like, x, n_table)) {
    return linear_pairs(table, n_table, like, experts, pairs, per_row, x, y, scratch, stream_ptr, ids);
  }
  run_pairs({table, nullptr, y, nullptr}, n_table, like, experts, pairs, per_row, x, scratch, stream_ptr, ids);
}

void linear_pairs_mma_two(const DeviceWeight* table, const DeviceWeight* second_table, int n_table,
                          const DeviceWeight& like, const int32_t* experts, int64_t pairs, int per_row, const float* x,
                          float* y, float* second_y, int32_t* scratch, void* stream_ptr) {
  if (pairs <= 0) return;
  if (!pairs_take(like, x, n_table)) {
    linear_pairs_mma(table, n_table, like, experts, pairs, per_row, x, y, scratch, stream_ptr);
    return linear_pairs_mma(second_table, n_table, like, experts, pairs, per_row, x, second_y, scratch, stream_ptr);
  }
  run_pairs({table, second_table, y, second_y}, n_table, like, experts, pairs, per_row, x, scratch, stream_ptr,
            ExpertIds::just_written);
}

void register_gemm_mma(Registry& registry) {
  // mma.sync m16n8k16 bf16 is on every GPU from sm_80 on.
  const auto add = [&](Op op) {
    KernelInfo k{.name = "cuda_mma_gemm",
                 .op = op,
                 .archs = ArchSet::gpus_from(Arch::sm_80),
                 .formats = {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4, WeightFormat::nvfp4},
                 .activations = {Activation::f32},
                 .priority = 2,
                 .summary = "tensor-core GEMM for any token count (mma.sync bf16, x as bf16 hi + lo), "
                            "a token's row independent of the batch"};
    registry.add(std::move(k.with_entry(&linear_mma)));
  };
  add(Op::dense_gemm);
  add(Op::lm_head);
  KernelInfo pairs{.name = "cuda_mma_pairs",
                   .op = Op::moe_gemm,
                   .archs = ArchSet::gpus_from(Arch::sm_80),
                   .formats = {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4, WeightFormat::nvfp4},
                   .activations = {Activation::f32},
                   .priority = 2,
                   .summary = "tensor-core GEMM per routed expert over its pairs, grouped on the device; "
                              "each pair's row as cuda_mma_gemm gives its token alone"};
  registry.add(std::move(pairs.with_entry(&linear_pairs_mma)));
}

}  // namespace keel::cuda
