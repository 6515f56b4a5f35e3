// Next-token choice from logits: greedy, or sampling with temperature, top-k, top-p and
// min-p (applied in that order, as vLLM and llama.cpp do), from a seeded generator.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace keel {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax; ties to the lower id)
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off; keeps p >= min_p · p_max
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // throws bad_input on out-of-range params
  int32_t next(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

int32_t argmax(std::span<const float> logits);

}  // namespace keel
