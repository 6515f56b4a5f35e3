// The CUDA attention kernels against ops/attention.h's `attend`: per query row one token,
// heads sharing the single K=V head, keys picked by index from one buffer (in any order,
// some repeated), sinks, at tiny and Flash-like sizes; outputs poisoned.
//
// The decode kernel computes in f32: tolerance 1e-5 · (1 + |want|). Both sides differ in
// the dot products' summation order (≤ ~1e-6 in a score at head_dim 512) and in the
// online softmax's rescaling (a few ULPs of each weight), so an output, a convex
// combination of keys of size ~1, moves by ~1e-6; a wrong key, head, sink or scale moves
// it by ~0.1.
//
// The tensor-core kernel splits each f32 factor into bf16 hi + lo and drops lo·lo: a
// product's error is at most 3·2^-16 of |a·b| (each part rounds at 2^-8 relative, the
// lo part's own rounding and the dropped lo·lo each add 2^-16). So a score moves by at
// most Δs = 2^-14 · scale · Σ_d |q_d·k_d|, the softmax weights by at most 2·max Δs in
// sum (first order), and the output by 2·max Δs·max|v| + 2^-14·max|v| besides the f32
// terms above. That bound is loose for random f32 data, so the kernel also runs on data
// that bf16 holds exactly (q and keys rounded to bf16: lo = 0, every product exact),
// where only the weights' split remains: 1e-4 · (1 + |want|) there, which a wrong key
// (~1/keys of an output, ≥ 1e-3 here) still exceeds.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "cuda/attention.h"
#include "gpu/device_memory.h"
#include "ops/attention.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

struct Case {
  int heads, head_dim;
  int64_t kv_rows;
  std::vector<int> keys;  // per sequence
  float sink_shift;       // added to every sink: a dominant sink when large
};

using Attend = decltype(&attend_decode);

// How a kernel is held to the reference (see the top of the file).
enum class Precision {
  f32,         // the decode kernel
  split,       // the tensor-core kernel on f32 data: the derived bound
  split_exact  // the tensor-core kernel on data bf16 holds exactly
};

float bf16_round(float x) {  // to nearest even, as the kernels' conversion
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

void check_case(const Case& c, uint32_t seed, Attend kernel = &attend_decode, Precision precision = Precision::f32) {
  const int sequences = static_cast<int>(c.keys.size());
  const int hd = c.head_dim, H = c.heads;
  std::vector<float> kv = random_normal(c.kv_rows * hd, seed);
  std::vector<float> q = random_normal(static_cast<size_t>(sequences) * H * hd, seed + 1, 2.0f);
  if (precision == Precision::split_exact) {
    for (float& x : kv) x = bf16_round(x);
    for (float& x : q) x = bf16_round(x);
  }
  std::vector<float> sinks = random_normal(H, seed + 2);
  for (float& s : sinks) s += c.sink_shift;
  std::mt19937 rng(seed + 3);
  std::uniform_int_distribution<int32_t> row(0, static_cast<int32_t>(c.kv_rows - 1));
  std::vector<int32_t> index, offsets = {0};
  for (const int n : c.keys) {
    for (int j = 0; j < n; ++j) index.push_back(row(rng));
    offsets.push_back(static_cast<int32_t>(index.size()));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  std::vector<float> want(q.size()), bound(q.size());
  for (int b = 0; b < sequences; ++b) {
    std::vector<const float*> keys;
    for (int32_t j = offsets[b]; j < offsets[b + 1]; ++j) keys.push_back(kv.data() + int64_t{index[j]} * hd);
    attend(std::span<const float>(q).subspan(size_t(b) * H * hd, size_t(H) * hd), H, hd, keys, sinks, scale,
           std::span<float>(want).subspan(size_t(b) * H * hd, size_t(H) * hd));
    for (int h = 0; h < H; ++h) {
      const float* qh = q.data() + (size_t(b) * H + h) * hd;
      double most = 0, vmax = 0;  // max_j Σ_d |q_d·k_jd|, max |v|
      for (const float* k : keys) {
        double sum = 0;
        for (int d = 0; d < hd; ++d) sum += std::fabs(double(qh[d]) * k[d]), vmax = std::max(vmax, double(std::fabs(k[d])));
        most = std::max(most, sum);
      }
      const double ds = std::ldexp(scale * most, -14);
      for (int d = 0; d < hd; ++d) {
        const size_t i = (size_t(b) * H + h) * hd + d;
        const double f32 = 1e-5 * (1 + std::fabs(want[i]));
        bound[i] = static_cast<float>(precision == Precision::f32           ? f32
                                      : precision == Precision::split_exact ? 1e-4 * (1 + std::fabs(want[i]))
                                                                            : 2 * ds * vmax + std::ldexp(vmax, -14) + f32);
      }
    }
  }

  float* dq = device_copy(q);
  float* dkv = device_copy(kv);
  float* dsinks = device_copy(sinks);
  int32_t* dindex = device_copy(index);
  int32_t* doffsets = device_copy(offsets);
  float* dout = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dout), q.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout, 0xff, q.size() * sizeof(float)), cudaSuccess);  // NaN poison
  const int max_keys = *std::max_element(c.keys.begin(), c.keys.end());
  const int64_t scratch_floats = attend_decode_scratch(sequences, H, hd, max_keys);
  float* dscratch = scratch_floats ? device_poisoned(scratch_floats) : nullptr;
  // The arrival counters start at zero, and every call must leave them so: the calls of
  // each sequence alone below reuse them.
  const int64_t counters = attend_decode_arrivals(sequences, H);
  unsigned* darrivals = device_copy(std::vector<unsigned>(counters, 0u));
  kernel(dq, sequences, H, hd, dkv, dindex, doffsets, dsinks, scale, dout, {dscratch, darrivals}, max_keys, {},
         nullptr);
  EXPECT_EQ(host_copy(darrivals, counters), std::vector<unsigned>(counters, 0u)) << "arrival counters left non-zero";
  std::vector<float> got(q.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], bound[i])
        << "heads " << H << " head_dim " << hd << " sequence " << i / (size_t(H) * hd) << " head "
        << i / hd % H << " channel " << i % hd;
  }
  // Each sequence alone, reading its keys as paged state (blocks of 3 rows, stored out
  // of order) through a block table: the same bits as in the call with all of them (a
  // list is split by its own length only).
  const size_t per_sequence = size_t(H) * hd;
  for (int b = 0; b < sequences; ++b) {
    DeviceScope scope;
    const std::vector<const float* const*> tables{scattered_table(scope, kv, hd, 3)};
    float* alone = device_poisoned(per_sequence);
    const int64_t alone_scratch = attend_decode_scratch(1, H, hd, c.keys[b]);
    float* dalone_scratch = alone_scratch ? device_poisoned(alone_scratch) : nullptr;
    kernel(dq + b * per_sequence, 1, H, hd, nullptr, dindex, doffsets + b, dsinks, scale, alone,
           {dalone_scratch, darrivals}, c.keys[b], PagedTables{scope.copy(tables), 3}, nullptr);
    const std::vector<float> one = host_copy(alone, per_sequence);
    EXPECT_EQ(std::memcmp(one.data(), got.data() + b * per_sequence, per_sequence * sizeof(float)), 0)
        << "sequence " << b << " alone differs from the batched call";
    cudaFree(alone);
    cudaFree(dalone_scratch);
  }
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dkv), static_cast<void*>(dsinks),
                  static_cast<void*>(dindex), static_cast<void*>(doffsets), static_cast<void*>(dout),
                  static_cast<void*>(dscratch), static_cast<void*>(darrivals)})
    cudaFree(p);
}

TEST(CudaAttention, TinyMatchesCpuReference) {
  // Sequences with no key (the sink alone: zero output), fewer than a tile, and several
  // tiles with a ragged end.
  check_case({.heads = 4, .head_dim = 32, .kv_rows = 50, .keys = {0, 5, 37, 8}, .sink_shift = 0.0f}, 51);
}

TEST(CudaAttention, RaggedHeadsAndHeadDim) {
  // Heads not a multiple of the block's group, head_dim not a multiple of the warp.
  check_case({.heads = 6, .head_dim = 100, .kv_rows = 300, .keys = {17, 250}, .sink_shift = 0.0f}, 61);
  check_case({.heads = 1, .head_dim = 1, .kv_rows = 10, .keys = {9}, .sink_shift = 0.0f}, 62);
}

TEST(CudaAttention, DominantSink) {
  check_case({.heads = 8, .head_dim = 64, .kv_rows = 100, .keys = {40, 3}, .sink_shift = 6.0f}, 71);
}

TEST(CudaAttention, FlashSizeMatchesCpuReference) {
  // Flash: 64 query heads of 512 over a 128-token window plus 512 selected compressed
  // entries, for two sequences.
  check_case({.heads = 64, .head_dim = 512, .kv_rows = 2048, .keys = {128 + 512, 128 + 512}, .sink_shift = 0.0f},
             81);
}

// Decode tokens over long key lists: the keys are split across blocks and the pieces
// merged; a short list beside a long one leaves some of its splits empty.
TEST(CudaAttention, SplitKeysMatchCpuReference) {
  check_case({.heads = 64, .head_dim = 512, .kv_rows = 4096, .keys = {128 + 2000}, .sink_shift = 0.0f}, 82);
  check_case({.heads = 8, .head_dim = 64, .kv_rows = 64, .keys = {1000, 3}, .sink_shift = 0.0f}, 83);
  check_case({.heads = 5, .head_dim = 96, .kv_rows = 300, .keys = {1000}, .sink_shift = 2.0f}, 84);
  // Splits of more keys than a block finds at once (128): 16 splits of 313 and of 294
  // keys, 3 passes each with a ragged last tile; whole float4 rows and (head_dim 100 is
  // not a multiple of 4) rows copied a float at a time.
  check_case({.heads = 8, .head_dim = 64, .kv_rows = 700, .keys = {5000, 4700, 2}, .sink_shift = 0.0f}, 85);
  check_case({.heads = 6, .head_dim = 100, .kv_rows = 500, .keys = {5000}, .sink_shift = 1.0f}, 86);
}

TEST(CudaAttention, RefusesHeadDimOverLimit) {
  EXPECT_THROW(attend_decode(nullptr, 1, 1, kMaxAttentionHeadDim + 1, nullptr, nullptr, nullptr, nullptr, 1.0f,
                             nullptr, {}, 1),
               std::runtime_error);
}

// The tensor-core kernel for prefill rows, at the decode tests' shapes and more: heads
// not a multiple of its 32 nor of 16, head_dim not a multiple of its 64 (nor of 4), key
// lists crossing its 16-key tiles and its 512-key splits, a row with no key.
void check_mma(const Case& c, uint32_t seed, decltype(&attend_mma) kernel = &attend_mma) {
  check_case(c, seed, kernel, Precision::split_exact);
  check_case(c, seed + 100, kernel, Precision::split);
}

TEST(CudaMmaAttention, TinyMatchesCpuReference) {
  check_mma({.heads = 4, .head_dim = 32, .kv_rows = 50, .keys = {0, 5, 37, 8}, .sink_shift = 0.0f}, 151);
}

TEST(CudaMmaAttention, RaggedHeadsAndHeadDim) {
  check_mma({.heads = 6, .head_dim = 100, .kv_rows = 300, .keys = {17, 250}, .sink_shift = 0.0f}, 161);
  check_mma({.heads = 1, .head_dim = 1, .kv_rows = 10, .keys = {9}, .sink_shift = 0.0f}, 162);
  check_mma({.heads = 40, .head_dim = 72, .kv_rows = 200, .keys = {33, 16, 1}, .sink_shift = 0.0f}, 163);
}

TEST(CudaMmaAttention, DominantSink) {
  check_mma({.heads = 8, .head_dim = 64, .kv_rows = 100, .keys = {40, 3}, .sink_shift = 6.0f}, 171);
}

TEST(CudaMmaAttention, FlashSizeMatchesCpuReference) {
  check_mma({.heads = 64, .head_dim = 512, .kv_rows = 2048, .keys = {128 + 512, 128 + 32, 128, 7}, .sink_shift = 0.0f},
            181);
}

TEST(CudaMmaAttention, SplitKeysMatchCpuReference) {
  check_mma({.heads = 64, .head_dim = 512, .kv_rows = 4096, .keys = {128 + 2000, 513}, .sink_shift = 0.0f}, 182);
  check_mma({.heads = 8, .head_dim = 64, .kv_rows = 64, .keys = {9000, 3}, .sink_shift = 0.0f}, 183);
}

// The same kernel's decode and verify entry, which splits lists every 32 keys (up to 16
// splits, then longer ones): lists shorter than a split, crossing splits with a ragged
// last one, past 16 splits, beside empty and one-key lists; ragged heads and head_dim.
TEST(CudaMmaAttention, DecodeEntryMatchesCpuReference) {
  const auto decode = &attend_mma_decode;
  check_mma({.heads = 4, .head_dim = 32, .kv_rows = 50, .keys = {0, 5, 37, 8}, .sink_shift = 0.0f}, 191, decode);
  check_mma({.heads = 40, .head_dim = 100, .kv_rows = 300, .keys = {33, 250, 1}, .sink_shift = 1.0f}, 192, decode);
  check_mma({.heads = 64, .head_dim = 512, .kv_rows = 2048, .keys = {128 + 512, 128 + 32, 7}, .sink_shift = 0.0f}, 193,
            decode);
  check_mma({.heads = 8, .head_dim = 64, .kv_rows = 700, .keys = {5000, 470, 2}, .sink_shift = 6.0f}, 194, decode);
}

TEST(CudaMmaAttention, RefusesHeadDimOverLimit) {
  EXPECT_THROW(attend_mma(nullptr, 1, 1, kMaxAttentionHeadDim + 1, nullptr, nullptr, nullptr, nullptr, 1.0f, nullptr,
                          {}, 1),
               std::runtime_error);
}

}  // namespace
}  // namespace keel::cuda
