// The CUDA RoPE against ops/rope.h over [tokens, heads, head_dim] with per-token
// positions (small and large), plain and YaRN frequencies, forward and inverse; and the
// norm + rope of an attention site's heads against ops/norm.h then ops/rope.h.
//
// The kernel works in place, as the CPU does, so instead of a poisoned output every
// channel is compared: the leading (nope) channels must come back bit for bit, the
// rotated ones within 1e-6 · (|a| + |b|) of the CPU, (a, b) the pair's inputs. Both take
// the same f32 angle float(position) · inv_freq[i]; the CPU rounds double cos/sin of it
// (≤ 0.5 ULP), sincosf is within 2 ULPs (CUDA programming guide, also for the large
// angles of far positions), so each factor differs by ≤ 2.5 · 2⁻²⁴ absolute; with the
// products' own rounding (and FMA contraction) that stays below 4e-7 · (|a| + |b|). A
// wrong angle, sign or pair is off by O(|a| + |b|).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cuda/rope.h"
#include "gpu/device_memory.h"
#include "ops/norm.h"
#include "ops/rope.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

struct Shape {
  int64_t tokens;
  int heads, head_dim, rope_dim;
  bool yarn;
};

// rope_dim rotated channels; with `yarn`, Flash's compress rope (YaRN, factor 16).
RopeConfig rope_config(int rope_dim, bool yarn) {
  RopeConfig c;
  c.rope_dim = rope_dim;
  if (yarn) {
    c.theta = 10000.0;
    c.yarn = true;
    c.yarn_factor = 16.0;
    c.yarn_original_max_position = 65536;
  }
  return c;
}

// Position 0, then small and far (past a million) ones in turn.
std::vector<int64_t> test_positions(int64_t tokens) {
  std::vector<int64_t> positions(tokens);
  for (int64_t t = 0; t < tokens; ++t) positions[t] = t == 0 ? 0 : t * 7 + (t % 2 ? 1000000 : 3);
  return positions;
}

TEST(CudaRope, MatchesCpuReferenceForwardAndInverse) {
  // tiny-like (32-wide heads, 16 rotated), Flash-like (512-wide, 64 rotated, YaRN), and a
  // head that is all rope.
  for (const Shape s : {Shape{5, 4, 32, 16, false}, Shape{3, 64, 512, 64, true}, Shape{2, 3, 8, 8, false}}) {
    const Rope host(rope_config(s.rope_dim, s.yarn));
    DeviceRope r = upload(host);
    const std::vector<int64_t> positions = test_positions(s.tokens);
    int64_t* dpos = device_copy(positions);
    for (const bool inverse : {false, true}) {
      const std::vector<float> x = random_normal(s.tokens * s.heads * s.head_dim, inverse ? 32 : 31);
      std::vector<float> want = x;
      for (int64_t t = 0; t < s.tokens; ++t) {
        host.apply_heads(std::span<float>(want).subspan(t * s.heads * s.head_dim, s.heads * s.head_dim), s.head_dim,
                         positions[t], inverse);
      }
      float* dx = device_copy(x);
      rope(r, dx, s.tokens, s.heads, s.head_dim, dpos, inverse);
      std::vector<float> got(x.size());
      ASSERT_EQ(cudaMemcpy(got.data(), dx, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      int moved = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const int d = static_cast<int>(i % s.head_dim);
        const int start = s.head_dim - s.rope_dim;
        if (d < start) {
          ASSERT_EQ(got[i], x[i]) << "nope channel changed at " << i;
          continue;
        }
        const size_t pair = i - (d - start) % 2;
        const float bound = 1e-6f * (std::fabs(x[pair]) + std::fabs(x[pair + 1]));
        ASSERT_NEAR(got[i], want[i], bound) << s.head_dim << "/" << s.rope_dim << (inverse ? " inverse" : "")
                                            << " at " << i;
        moved += got[i] != x[i];
      }
      EXPECT_GT(moved, static_cast<int>(x.size()) / 4 * s.rope_dim / s.head_dim);  // it did rotate
      cudaFree(dx);
    }
    cudaFree(dpos);
    release(r);
  }
}

TEST(CudaRope, InverseUndoesForward) {
  RopeConfig c;
  c.rope_dim = 64;
  const Rope host(c);
  DeviceRope r = upload(host);
  const std::vector<int64_t> positions = {0, 1, 4095, 123457};
  int64_t* dpos = device_copy(positions);
  const std::vector<float> x = random_normal(4 * 8 * 128, 41);
  float* dx = device_copy(x);
  rope(r, dx, 4, 8, 128, dpos, false);
  rope(r, dx, 4, 8, 128, dpos, true);
  std::vector<float> got(x.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dx, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  // Two rotations: twice the single one's bound; the 64 leading channels exact.
  for (size_t i = 0; i < x.size(); ++i) {
    const int d = static_cast<int>(i % 128);
    if (d < 64) {
      ASSERT_EQ(got[i], x[i]) << i;
      continue;
    }
    const size_t pair = i - (d - 64) % 2;
    ASSERT_NEAR(got[i], x[i], 2e-6f * (std::fabs(x[pair]) + std::fabs(x[pair + 1]))) << i;
  }
  cudaFree(dx);
  cudaFree(dpos);
  release(r);
}

// norm_rope against ops/norm.h then ops/rope.h, weighted and unweighted: Flash's q heads
// (64 of 512, 64 rotated, YaRN) and kv row, a tiny model's 32-wide heads (a block of
// one warp, most of it past the row), a head whose rope starts mid-chunk (40 wide, 18
// rotated), one that is all rope, and rows the one-launch kernel does not take (30
// wide: single floats; 4100: past a block) through the fallback. In place, so every
// channel is compared: within the norm's 1e-5 relative (its sum of squares in another
// order, test_norm_cuda.cpp), the rotated ones within 1e-5 · (|a| + |b|) of the CPU,
// (a, b) the pair after the CPU's norm (the rotation's own error is 4e-7 of that).
TEST(CudaRope, NormRopeMatchesCpuNormThenRope) {
  struct Case {
    int64_t tokens;
    int heads, head_dim, rope_dim;
    bool weighted, yarn;
  };
  for (const Case s : {Case{3, 64, 512, 64, false, true}, Case{3, 1, 512, 64, true, true},
                       Case{5, 4, 32, 16, false, false}, Case{2, 3, 40, 18, true, false}, Case{2, 3, 8, 8, true, false},
                       Case{2, 2, 30, 16, true, false}, Case{2, 1, 4100, 64, false, false}}) {
    const Rope host(rope_config(s.rope_dim, s.yarn));
    DeviceRope r = upload(host);
    const std::vector<int64_t> positions = test_positions(s.tokens);
    const std::vector<float> x = random_normal(s.tokens * s.heads * s.head_dim, 51, 3.0f);
    const std::vector<float> weight = random_normal(s.head_dim, 52);
    const float eps = 1e-6f;
    std::vector<float> normed = x;
    for (int64_t row = 0; row < s.tokens * s.heads; ++row) {
      const std::span<float> head = std::span<float>(normed).subspan(row * s.head_dim, s.head_dim);
      if (s.weighted) {
        keel::rms_norm(head, weight, eps, head);
      } else {
        keel::rms_norm_unweighted(head, eps);
      }
    }
    std::vector<float> want = normed;
    for (int64_t t = 0; t < s.tokens; ++t) {
      host.apply_heads(std::span<float>(want).subspan(t * s.heads * s.head_dim, s.heads * s.head_dim), s.head_dim,
                       positions[t], false);
    }
    DeviceScope scope;
    float* dx = scope.copy(x);
    norm_rope(r, dx, s.tokens, s.heads, s.head_dim, s.weighted ? scope.copy(weight) : nullptr, eps,
              scope.copy(positions));
    const std::vector<float> got = host_copy(dx, x.size());
    const std::string at = std::to_string(s.head_dim) + "/" + std::to_string(s.rope_dim) + " heads " +
                           std::to_string(s.heads) + (s.weighted ? " weighted" : "");
    const int start = s.head_dim - s.rope_dim;
    for (size_t i = 0; i < x.size(); ++i) {
      const int d = static_cast<int>(i % s.head_dim);
      if (d < start) {
        ASSERT_NEAR(got[i], want[i], 1e-5f * std::fabs(want[i])) << at << " nope channel " << i;
        continue;
      }
      const size_t pair = i - (d - start) % 2;
      ASSERT_NEAR(got[i], want[i], 1e-5f * (std::fabs(normed[pair]) + std::fabs(normed[pair + 1])))
          << at << " rotated channel " << i;
    }
    release(r);
  }
}

// Pieces in one call, as an attention site passes its q heads (unweighted) and its kv
// row (weighted): bit for bit each piece as norm_rope gives it alone. Once with both in
// the one launch, once with the kv row one float off float4 alignment, so that it takes
// the two-kernel path beside the launch.
TEST(CudaRope, NormRopePiecesMatchEachAlone) {
  const int64_t tokens = 3;
  const int heads = 64, head_dim = 512;
  const Rope host(rope_config(64, true));
  DeviceRope r = upload(host);
  const std::vector<float> q = random_normal(tokens * heads * head_dim, 53, 3.0f);
  const std::vector<float> kv = random_normal(tokens * head_dim + 1, 54, 3.0f);
  const std::vector<float> weight = random_normal(head_dim, 55);
  const float eps = 1e-6f;
  for (const int64_t kv_offset : {0, 1}) {
    DeviceScope scope;
    const int64_t* positions = scope.copy(test_positions(tokens));
    const float* w = scope.copy(weight);
    float *q_alone = scope.copy(q), *kv_alone = scope.copy(kv) + kv_offset;
    norm_rope(r, q_alone, tokens, heads, head_dim, nullptr, eps, positions);
    norm_rope(r, kv_alone, tokens, 1, head_dim, w, eps, positions);
    float *q_both = scope.copy(q), *kv_both = scope.copy(kv) + kv_offset;
    const NormRopePiece pieces[] = {{q_both, heads, nullptr}, {kv_both, 1, w}};
    norm_rope(r, pieces, tokens, head_dim, eps, positions);
    const auto same = [&](const float* a, const float* b, size_t n, const char* what) {
      const std::vector<float> x = host_copy(a, n), y = host_copy(b, n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(&x[i], &y[i], sizeof(float)), 0)
            << what << " (kv offset " << kv_offset << ") at " << i << ": " << x[i] << " vs " << y[i];
      }
    };
    same(q_alone, q_both, q.size(), "q");
    same(kv_alone, kv_both, tokens * head_dim, "kv");
  }
  release(r);
}

TEST(CudaRope, RefusesOddOrOversizedRopeDim) {
  RopeConfig c;
  c.rope_dim = 64;
  DeviceRope r = upload(Rope(c));
  EXPECT_THROW(rope(r, nullptr, 1, 1, 32, nullptr, false), std::runtime_error);
  release(r);
}

}  // namespace
}  // namespace keel::cuda
