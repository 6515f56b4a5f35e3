#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "base/error.h"

namespace keel {

int32_t argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

Sampler::Sampler(const SamplingParams& p) : params_(p), rng_(p.seed) {
  const auto bad = [](const std::string& field, const std::string& why) {
    fail(ErrorCode::bad_input, {.field = field}, why);
  };
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) bad("temperature", "must be a finite value >= 0");
  if (p.top_k < 0) bad("top_k", "must be >= 0 (0 turns it off)");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) bad("top_p", "must be in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) bad("min_p", "must be in [0, 1]");
}

int32_t Sampler::next(std::span<const float> logits) {
  if (params_.temperature == 0.0f) return argmax(logits);
  // Candidates by descending logit; each filter keeps a prefix.
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  size_t keep = ids.size();
  if (params_.top_k > 0) keep = std::min(keep, static_cast<size_t>(params_.top_k));
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  std::vector<double> p(keep);
  const double top = logits[ids[0]];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += p[i] = std::exp((logits[ids[i]] - top) / params_.temperature);
  for (double& v : p) v /= sum;
  if (params_.top_p < 1.0f) {  // the smallest prefix whose mass reaches top_p
    double mass = 0;
    size_t n = 0;
    while (n < keep && mass < params_.top_p) mass += p[n++];
    keep = n;
  }
  if (params_.min_p > 0.0f) {
    const double floor = params_.min_p * p[0];
    keep = static_cast<size_t>(std::find_if(p.begin(), p.begin() + keep, [&](double v) { return v < floor; }) - p.begin());
  }
  std::discrete_distribution<size_t> pick(p.begin(), p.begin() + keep);
  return ids[pick(rng_)];
}

}  // namespace keel
