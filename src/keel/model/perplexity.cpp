#include "model/perplexity.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "base/error.h"

namespace keel {

double PerplexityResult::perplexity() const { return std::exp(nats_per_token()); }

double token_nll(std::span<const float> logits, int32_t target) {
  const double top = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float v : logits) sum += std::exp(v - top);
  return std::log(sum) + top - logits[target];
}

PerplexityResult perplexity(const Model& model, std::span<const int32_t> ids, int64_t context,
                            const PerplexityProgress& progress) {
  if (context < 2) fail(ErrorCode::bad_input, {.field = "context"}, "must be at least 2 tokens");
  if (ids.size() < 2) fail(ErrorCode::bad_input, {}, "perplexity needs at least 2 tokens");
  const int64_t V = model.config().vocab_size;
  PerplexityResult r;
  for (size_t start = 0; start + 1 < ids.size(); start += context) {
    const auto window = ids.subspan(start, std::min<size_t>(context, ids.size() - start));
    Sequence seq = model.new_sequence();
    const std::vector<float> logits = model.forward(seq, window);
    for (size_t t = 0; t + 1 < window.size(); ++t) {
      r.nll_sum += token_nll(std::span(logits).subspan(t * V, V), window[t + 1]);
      ++r.predicted;
    }
    ++r.windows;
    if (progress) progress(r);
  }
  return r;
}

}  // namespace keel
