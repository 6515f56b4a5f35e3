#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "base/error.h"
#include "ops/sampling_noise.h"

namespace keel {
namespace {

bool greedy(const SamplingParams& p) { return p.temperature == 0.0f; }
// Sampling over the whole row: no filter needs the tokens in order.
bool whole_row(const SamplingParams& p) { return !greedy(p) && p.top_k == 0 && p.top_p >= 1.0f; }

// The scaled logit (l − max)/T and its Gumbel key, as the device computes them: one
// IEEE subtraction, division and addition, so every device gets the same bits.
float scaled(float logit, float max, float temperature) { return (logit - max) / temperature; }

// Whether key a (token ia) beats key b (token ib): larger, ties to the lower id.
bool beats(float a, int32_t ia, float b, int32_t ib) { return a > b || (a == b && ia < ib); }

}  // namespace

int32_t argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

void check(const SamplingParams& p) {
  const auto bad = [](const std::string& field, const std::string& why) {
    fail(ErrorCode::bad_input, {.field = field}, why);
  };
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) bad("temperature", "must be a finite value >= 0");
  if (p.top_k < 0) bad("top_k", "must be >= 0 (0 turns it off)");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) bad("top_p", "must be in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) bad("min_p", "must be in [0, 1]");
}

int candidates_needed(const SamplingParams& p) {
  if (greedy(p) || whole_row(p)) return 1;
  return p.top_k > 0 ? std::min(p.top_k, kMaxCandidates) : kMaxCandidates;
}

SummaryTask summary_task(const SamplingParams& p, uint64_t draw, int candidates) {
  return {.temperature = p.temperature,
          .log_min_p = p.min_p > 0.0f ? std::log(p.min_p) : -std::numeric_limits<float>::infinity(),
          .seed = p.seed,
          .draw = draw,
          .candidates = std::max(1, candidates),
          .whole_pick = whole_row(p)};
}

RowSummary summarize(std::span<const float> logits, const SummaryTask& task) {
  RowSummary s;
  s.vocab = static_cast<int64_t>(logits.size());
  if (logits.empty()) return s;
  const float m = *std::max_element(logits.begin(), logits.end());
  double sum = 0, sum_t = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - m);
  s.max_logit = m;
  s.log_z = m + static_cast<float>(std::log(sum));
  const float t = task.temperature;
  if (t > 0.0f) {
    for (float v : logits) sum_t += std::exp(static_cast<double>(scaled(v, m, t)));
    s.z_t = static_cast<float>(sum_t);
  }
  if (task.whole_pick) {
    float best = 0;
    for (int32_t i = 0; i < static_cast<int32_t>(logits.size()); ++i) {
      const float k = scaled(logits[i], m, t);
      if (!(k >= task.log_min_p)) continue;
      const float key = k + gumbel_noise(task.seed, task.draw, i);
      if (s.whole_pick < 0 || beats(key, i, best, s.whole_pick)) {
        best = key;
        s.whole_pick = i;
      }
    }
    s.whole_pick_logit = logits[s.whole_pick];
  }
  const size_t n = std::min(logits.size(), static_cast<size_t>(task.candidates));
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(),
                    [&](int32_t a, int32_t b) { return beats(logits[a], a, logits[b], b); });
  ids.resize(n);
  s.logits.reserve(n);
  for (int32_t id : ids) s.logits.push_back(logits[id]);
  s.ids = std::move(ids);
  return s;
}

namespace {

// The candidates the filters keep: a prefix of the summary's list.
size_t kept_prefix(const SamplingParams& p, const RowSummary& s) {
  const float t = p.temperature, m = s.max_logit;
  size_t n = s.ids.size();
  if (p.top_k > 0) n = std::min(n, static_cast<size_t>(p.top_k));
  if (p.top_p < 1.0f) {  // the smallest prefix whose mass reaches top_p
    double norm = 0;
    if (p.top_k > 0) {
      for (size_t i = 0; i < n; ++i) norm += std::exp(static_cast<double>(scaled(s.logits[i], m, t)));
    } else {
      norm = s.z_t;
    }
    double mass = 0;
    size_t k = 0;
    while (k < n && mass < p.top_p) mass += std::exp(static_cast<double>(scaled(s.logits[k++], m, t))) / norm;
    n = k;
  }
  if (p.min_p > 0.0f) {
    const float floor = std::log(p.min_p);
    size_t k = 0;
    while (k < n && scaled(s.logits[k], m, t) >= floor) ++k;
    n = std::max<size_t>(k, 1);
  }
  return n;
}

}  // namespace

bool summary_suffices(const SamplingParams& p, const RowSummary& s) {
  if (s.ids.empty()) return false;
  if (greedy(p)) return true;
  if (whole_row(p)) return s.whole_pick >= 0;
  if (static_cast<int64_t>(s.ids.size()) == s.vocab) return true;
  if (p.top_k > 0) return s.ids.size() >= static_cast<size_t>(p.top_k);
  // Top-p alone: the candidates must carry the mass.
  double mass = 0;
  for (float l : s.logits) mass += std::exp(static_cast<double>(scaled(l, s.max_logit, p.temperature))) / s.z_t;
  return mass >= p.top_p;
}

int32_t choose(const SamplingParams& p, uint64_t draw, const RowSummary& s) {
  if (!summary_suffices(p, s)) fail(ErrorCode::usage, {}, "a sampling summary without the candidates its choice needs");
  if (greedy(p)) return s.ids.front();
  if (whole_row(p)) return s.whole_pick;
  const size_t keep = kept_prefix(p, s);
  size_t best = 0;
  float best_key = 0;
  for (size_t i = 0; i < keep; ++i) {
    const float key = scaled(s.logits[i], s.max_logit, p.temperature) + gumbel_noise(p.seed, draw, s.ids[i]);
    if (i == 0 || beats(key, s.ids[i], best_key, s.ids[best])) {
      best = i;
      best_key = key;
    }
  }
  return s.ids[best];
}

PickKind pick_kind(const SamplingParams& p) {
  if (greedy(p)) return PickKind::first_candidate;
  return whole_row(p) ? PickKind::whole_row : PickKind::candidates;
}

float logprob_of(const RowSummary& s, int32_t token) {
  if (token == s.whole_pick) return s.whole_pick_logit - s.log_z;
  const auto at = std::find(s.ids.begin(), s.ids.end(), token);
  if (at == s.ids.end()) fail(ErrorCode::usage, {}, "a logprob asked for a token the sampling summary does not hold");
  return s.logits[static_cast<size_t>(at - s.ids.begin())] - s.log_z;
}

Sampler::Sampler(const SamplingParams& p) : params_(p) { check(p); }

SummaryTask summary_task(const RowChoice& c) {
  return summary_task(c.params, c.draw, std::max(c.candidates, candidates_needed(c.params)));
}

RowSummary summarize_for(std::span<const float> logits, const RowChoice& choice) {
  SummaryTask task = summary_task(choice);
  RowSummary s = summarize(logits, task);
  if (!summary_suffices(choice.params, s)) {
    task.candidates = static_cast<int>(logits.size());
    s = summarize(logits, task);
  }
  return s;
}

int32_t Sampler::next(std::span<const float> logits) { return next(summarize_for(logits, {params_, draws_, 1})); }

int32_t Sampler::next(const RowSummary& summary) {
  const int32_t token = choose(params_, draws_, summary);
  ++draws_;
  return token;
}

}  // namespace keel
