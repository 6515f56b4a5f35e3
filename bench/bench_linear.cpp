// The CPU matrix kernel in every stored format: one token (decode, memory-bound: the
// figure is weight bytes read per second) and 64 tokens (prefill).
#include <benchmark/benchmark.h>

#include <random>

#include "model/owned_weight.h"
#include "ops/linear.h"

namespace keel {
namespace {

std::vector<float> normal(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void BM_Linear(benchmark::State& state, WeightFormat format, DType dtype) {
  const int64_t out = 4096, in = 4096, tokens = state.range(0);
  const OwnedWeight w(normal(out * in, 1), out, in, format, dtype);
  const std::vector<float> x = normal(tokens * in, 2);
  std::vector<float> y(tokens * out);
  for (auto _ : state) {
    linear(w.weight(), rows_of(std::span<const float>(x), in), rows_of(std::span<float>(y), out));
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * w.bytes()));
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(state.iterations() * tokens), benchmark::Counter::kIsRate);
}

BENCHMARK_CAPTURE(BM_Linear, f32, WeightFormat::f32, DType::f32)->Arg(1)->Arg(64)->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, bf16, WeightFormat::bf16, DType::bf16)->Arg(1)->Arg(64)->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, fp8_block, WeightFormat::fp8_block, DType::f8_e4m3)->Arg(1)->Arg(64)->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, mxfp4, WeightFormat::mxfp4, DType::i8)->Arg(1)->Arg(64)->UseRealTime();
BENCHMARK_CAPTURE(BM_Linear, nvfp4, WeightFormat::nvfp4, DType::u8)->Arg(1)->Arg(64)->UseRealTime();

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
