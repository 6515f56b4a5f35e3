// The CUDA matrix kernel against the CPU reference (ops/linear.h's linear_reference,
// f64 sums over the quant/ dequantizers) for every stored format, on random weights
// and inputs, at sizes that cross the row tiles, token tiles and scale blocks, outputs
// poisoned; and against itself: a token in a tile gives what it gives alone.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>

#include "cuda/linear.h"
#include "gpu/device_memory.h"
#include "gpu/weight_cases.h"
#include "model/owned_weight.h"
#include "ops/linear.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

class CudaLinear : public ::testing::TestWithParam<WeightCase> {};

TEST_P(CudaLinear, MatchesCpuReference) {
  const WeightCase& c = GetParam();
  // out: not a multiple of the 32-row tile nor of 128; in: crosses FP8 blocks unevenly;
  // and a width that is no whole number of 16-byte chunks (the any-width kernel; FP4
  // blocks always hold 32 values, so it has none).
  const bool fp4 = is_fp4(c);
  std::vector<std::pair<int64_t, int64_t>> shapes{{261, 320}, {1029, 4096 + 128}, {7, 64}};
  if (!fp4) shapes.push_back({37, 24});
  for (const auto& [out, in] : shapes) {
    const OwnedWeight host(random_normal(out * in, 5), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    for (const int64_t tokens : {1, 3}) {
      const std::vector<float> x = random_normal(tokens * in, 6);
      std::vector<float> want(tokens * out);
      keel::linear_reference(host.weight(), keel::rows_of(std::span<const float>(x), in),
                             keel::rows_of(std::span<float>(want), out));
      float* dx = device_copy(x);
      float* dy = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dy), want.size() * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(dy, 0xff, want.size() * sizeof(float)), cudaSuccess);  // NaN poison
      linear(w, dx, dy, tokens);
      std::vector<float> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), dy, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-4f * (1.0f + std::fabs(want[i])))
            << c.name << " " << out << "x" << in << " tokens " << tokens << " at " << i;
      }
      cudaFree(dx);
      cudaFree(dy);
    }
    release(w);
  }
}

// A call's tokens go through the weight in tiles, each weight chunk read and decoded
// once per tile. Every token's output must match the CPU reference and be, bit for bit,
// what a call with that token alone gives: a request's results do not depend on the
// batch it runs in. Token counts below, at and past the tile of 8.
TEST_P(CudaLinear, TokenTilesMatchOneTokenCalls) {
  const WeightCase& c = GetParam();
  // out: no multiple of a block's or a warp's rows, so the last warp has rows past the
  // end; in: FP8 scale blocks crossed unevenly, fewer and more chunks than a warp's
  // lanes (a partial last step); and but for FP4 (whose blocks hold 32 values), a width
  // that is no whole number of 16-byte chunks (the any-width kernel, a token at a time).
  std::vector<std::pair<int64_t, int64_t>> shapes{{261, 320}, {77, 1152}};
  if (!is_fp4(c)) shapes.push_back({37, 26});
  for (const auto& [out, in] : shapes) {
    const OwnedWeight host(random_normal(out * in, 11), out, in, c.format, c.dtype, c.scales);
    DeviceWeight w = upload(host.weight());
    float* alone = device_poisoned(out);
    for (const int64_t tokens : {1, 7, 8, 9, 17, 64}) {
      const std::vector<float> x = random_normal(tokens * in, static_cast<uint32_t>(12 + tokens));
      std::vector<float> want(tokens * out);
      keel::linear_reference(host.weight(), keel::rows_of(std::span<const float>(x), in),
                             keel::rows_of(std::span<float>(want), out));
      float* dx = device_copy(x);
      float* dy = device_poisoned(tokens * out);
      linear(w, dx, dy, tokens);
      const std::vector<float> got = host_copy(dy, tokens * out);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-4f * (1.0f + std::fabs(want[i])))
            << c.name << " " << out << "x" << in << " tokens " << tokens << " at " << i;
      }
      for (int64_t t = 0; t < tokens; ++t) {
        ASSERT_EQ(cudaMemset(alone, 0xff, out * sizeof(float)), cudaSuccess);
        linear(w, dx + t * in, alone, 1);
        const std::vector<float> one = host_copy(alone, out);
        ASSERT_EQ(std::memcmp(one.data(), got.data() + t * out, out * sizeof(float)), 0)
            << c.name << " " << out << "x" << in << ": token " << t << " of " << tokens
            << " differs from the same token alone";
      }
      cudaFree(dx);
      cudaFree(dy);
    }
    cudaFree(alone);
    release(w);
  }
}

// Expert pairs read their expert from the device: each pair against the CPU reference of
// its expert's matrix on its token's row, and bit for bit against linear() on that row;
// a negative expert and an expert without data (another rank's) give zeros.
TEST_P(CudaLinear, PairsMatchCpuReference) {
  const WeightCase& c = GetParam();
  const bool fp4 = is_fp4(c);
  std::vector<std::pair<int64_t, int64_t>> shapes{{261, 320}};
  if (!fp4) shapes.push_back({37, 24});
  for (const auto& [out, in] : shapes) {
    constexpr int kExperts = 5, kPerRow = 2;
    std::vector<std::unique_ptr<OwnedWeight>> hosts;  // weights point into their owners: never moved
    std::vector<DeviceWeight> table;
    for (int e = 0; e < kExperts; ++e) {
      hosts.push_back(std::make_unique<OwnedWeight>(random_normal(out * in, 40 + e), out, in, c.format, c.dtype,
                                                    c.scales));
      table.push_back(upload(hosts.back()->weight()));
    }
    DeviceWeight elsewhere = table[1];
    table[1] = DeviceWeight{};  // held by another rank
    const std::vector<int32_t> experts{4, 0, 2, 2, -1, 1};
    const int64_t pairs = static_cast<int64_t>(experts.size()), tokens = pairs / kPerRow;
    const std::vector<float> x = random_normal(tokens * in, 7);
    DeviceWeight* dtable = device_copy(table);
    int32_t* dexperts = device_copy(experts);
    float* dx = device_copy(x);
    float* dy = device_poisoned(pairs * out);
    linear_pairs(dtable, kExperts, table[0], dexperts, pairs, kPerRow, dx, dy, nullptr);  // scratch: unused
    const std::vector<float> got = host_copy(dy, pairs * out);
    for (int64_t p = 0; p < pairs; ++p) {
      std::vector<float> want(out, 0.0f);
      if (experts[p] >= 0 && experts[p] != 1) {
        keel::linear_reference(hosts[experts[p]]->weight(),
                               keel::ConstRows{x.data() + (p / kPerRow) * in, 1, in},
                               keel::rows_of(std::span<float>(want), out));
      }
      for (int64_t o = 0; o < out; ++o) {
        ASSERT_NEAR(got[p * out + o], want[o], 2e-4f * (1.0f + std::fabs(want[o])))
            << c.name << " " << out << "x" << in << " pair " << p << " (expert " << experts[p] << ") row " << o;
      }
      if (experts[p] >= 0 && experts[p] != 1) {  // the same product as linear() gives the token alone
        float* alone = device_poisoned(out);
        linear(table[experts[p]], dx + (p / kPerRow) * in, alone, 1);
        const std::vector<float> one = host_copy(alone, out);
        ASSERT_EQ(std::memcmp(one.data(), got.data() + p * out, out * sizeof(float)), 0)
            << c.name << " " << out << "x" << in << " pair " << p << " differs from linear()";
        cudaFree(alone);
      }
    }
    table[1] = elsewhere;
    for (DeviceWeight& w : table) release(w);
    for (void* q : {static_cast<void*>(dtable), static_cast<void*>(dexperts), static_cast<void*>(dx),
                    static_cast<void*>(dy)})
      cudaFree(q);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaLinear, ::testing::Values(kF32, kBf16, kFp8Ue8m0, kFp8F32, kMxfp4, kNvfp4),
                         case_name);

}  // namespace
}  // namespace keel::cuda
