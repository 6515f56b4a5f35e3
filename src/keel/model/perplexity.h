// Perplexity of a token sequence, scored in consecutive windows of `context` tokens
// (each window starts a fresh sequence; every token but a window's first is predicted
// from the tokens before it in its window), as llama.cpp's perplexity tool reports it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "model/model.h"

namespace keel {

struct PerplexityResult {
  double nll_sum = 0;      // Σ −log p(token | prefix), nats
  int64_t predicted = 0;   // tokens scored
  int64_t windows = 0;
  double nats_per_token() const { return predicted ? nll_sum / predicted : 0; }
  double perplexity() const;
};

// Called after each window with the running result.
using PerplexityProgress = std::function<void(const PerplexityResult&)>;

PerplexityResult perplexity(const Model& model, std::span<const int32_t> ids, int64_t context,
                            const PerplexityProgress& progress = {});

// −log softmax(logits)[target], in f64.
double token_nll(std::span<const float> logits, int32_t target);

}  // namespace keel
