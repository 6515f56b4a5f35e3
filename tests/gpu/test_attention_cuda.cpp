// The CUDA decode attention against ops/attention.h's `attend`: per sequence one query
// token, heads sharing the single K=V head, keys picked by index from one buffer (in
// any order, some repeated), sinks, at tiny and Flash-like sizes; outputs poisoned.
//
// Tolerance 1e-5 · (1 + |want|): both sides compute in f32. They differ in the dot
// products' summation order (≤ ~1e-6 in a score at head_dim 512) and in the online
// softmax's rescaling (a few ULPs of each weight), so an output, a convex combination of
// keys of size ~1, moves by ~1e-6; a wrong key, head, sink or scale moves it by ~0.1.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

void check_case(const Case& c, uint32_t seed) {
  const int sequences = static_cast<int>(c.keys.size());
  const int hd = c.head_dim, H = c.heads;
  const std::vector<float> kv = random_normal(c.kv_rows * hd, seed);
  const std::vector<float> q = random_normal(static_cast<size_t>(sequences) * H * hd, seed + 1, 2.0f);
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

  std::vector<float> want(q.size());
  for (int b = 0; b < sequences; ++b) {
    std::vector<const float*> keys;
    for (int32_t j = offsets[b]; j < offsets[b + 1]; ++j) keys.push_back(kv.data() + int64_t{index[j]} * hd);
    attend(std::span<const float>(q).subspan(size_t(b) * H * hd, size_t(H) * hd), H, hd, keys, sinks, scale,
           std::span<float>(want).subspan(size_t(b) * H * hd, size_t(H) * hd));
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
  attend_decode(dq, sequences, H, hd, dkv, dindex, doffsets, dsinks, scale, dout, dscratch, max_keys);
  std::vector<float> got(q.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i])))
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
    attend_decode(dq + b * per_sequence, 1, H, hd, nullptr, dindex, doffsets + b, dsinks, scale, alone,
                  dalone_scratch, c.keys[b], PagedTables{scope.copy(tables), 3});
    const std::vector<float> one = host_copy(alone, per_sequence);
    EXPECT_EQ(std::memcmp(one.data(), got.data() + b * per_sequence, per_sequence * sizeof(float)), 0)
        << "sequence " << b << " alone differs from the batched call";
    cudaFree(alone);
    cudaFree(dalone_scratch);
  }
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dkv), static_cast<void*>(dsinks),
                  static_cast<void*>(dindex), static_cast<void*>(doffsets), static_cast<void*>(dout),
                  static_cast<void*>(dscratch)})
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
}

TEST(CudaAttention, RefusesHeadDimOverLimit) {
  EXPECT_THROW(attend_decode(nullptr, 1, 1, kMaxAttentionHeadDim + 1, nullptr, nullptr, nullptr, nullptr, 1.0f,
                             nullptr, nullptr, 1),
               std::runtime_error);
}

}  // namespace
}  // namespace keel::cuda
