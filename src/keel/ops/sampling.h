// Next-token choice from logits: greedy, or sampling with temperature, top-k, top-p and
// min-p (applied in that order, as vLLM and llama.cpp do), from a seeded stream.
//
// A choice runs in two steps, so that a batch's logits need not leave the device that
// computed them: `summarize` reduces a row to what any choice needs (the best
// candidates in order, the normalizers, and a sampled pick over the whole row), where
// the logits are; `choose` takes the token from that summary alone, on the host.
// Sampling is the Gumbel-max trick: of the tokens the filters keep, the one with the
// largest (l − max)/T + G, with G Gumbel noise from (seed, draw, token)
// (ops/sampling_noise.h). That is an exact draw from softmax(l/T) over the kept tokens,
// and it is the same token on every device for the same logits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace keel {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax; ties to the lower id)
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off; keeps p >= min_p · p_max
  uint64_t seed = 0;
};

// Throws Error(bad_input) naming the field for an out-of-range parameter.
void check(const SamplingParams& params);

// The most candidates a device summary holds; a choice that needs more (top_k above it,
// or a top-p mass not reached within it) takes the whole row instead.
inline constexpr int kMaxCandidates = 1024;

// What a choice needs from one row of logits.
struct RowSummary {
  int64_t vocab = 0;
  float max_logit = 0;
  float log_z = 0;  // ln Σ exp(l) over the row: logprob = l − log_z
  float z_t = 0;    // Σ exp((l − max)/T) over the row (sampling only)
  // Sampling with neither top-k nor top-p: the Gumbel-max token over the tokens min-p
  // keeps, found over the whole row (-1 otherwise), and its logit.
  int32_t whole_pick = -1;
  float whole_pick_logit = 0;
  // The best tokens by logit, descending, ties to the lower id.
  std::vector<int32_t> ids;
  std::vector<float> logits;
};

// What summarize computes for one row with `params`, as a device kernel takes it.
struct SummaryTask {
  float temperature = 0;
  float log_min_p = 0;     // ln(min_p): min-p keeps (l − max)/T >= it; -inf when off
  uint64_t seed = 0, draw = 0;
  int candidates = 1;      // how many best tokens to list (1..kMaxCandidates)
  bool whole_pick = false; // find RowSummary::whole_pick
};

// The task for draw `draw` of a stream with `params`, listing at least `candidates`.
SummaryTask summary_task(const SamplingParams& params, uint64_t draw, int candidates);
// How many candidates `choose` needs with `params` (capped at kMaxCandidates).
int candidates_needed(const SamplingParams& params);

// The reference reduction (a device kernel computes the same, tested against this).
RowSummary summarize(std::span<const float> logits, const SummaryTask& task);

// One row's choice as a batched forward takes it: the stream's parameters, which draw,
// and at least how many candidates to list (for top logprobs).
struct RowChoice {
  SamplingParams params;
  uint64_t draw = 0;
  int candidates = 1;
};
SummaryTask summary_task(const RowChoice& choice);
// summarize for `choice`, again with every token as a candidate when that does not
// suffice: what a device that kept the row does on the host for such a row.
RowSummary summarize_for(std::span<const float> logits, const RowChoice& choice);
// Whether `choose` can decide from `summary`; when not, summarize the row again with
// every token as a candidate.
bool summary_suffices(const SamplingParams& params, const RowSummary& summary);
// The token for draw `draw` (a summary that suffices).
int32_t choose(const SamplingParams& params, uint64_t draw, const RowSummary& summary);
// Where `choose` takes its token from: the first candidate (greedy), the whole-row pick
// (sampling with neither top-k nor top-p), or a draw among the candidates. A device that
// made the summary can take the first two itself, so that the next step need not wait
// for the token to reach the host (pipelined decode, Executor::begin_choices).
enum class PickKind { first_candidate, whole_row, candidates };
PickKind pick_kind(const SamplingParams& params);
// ln p of `token` under softmax(l), when the summary knows its logit (candidates or the
// whole-row pick); `top` logprobs come from the candidates.
float logprob_of(const RowSummary& summary, int32_t token);

// One request's stream of choices: draw i uses noise (seed, i).
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // check(params)
  const SamplingParams& params() const { return params_; }
  uint64_t draws() const { return draws_; }
  // Summarizes the row here (summarize_for) and chooses.
  int32_t next(std::span<const float> logits);
  // Chooses from a summary made for draw draws() (summary_suffices must hold).
  int32_t next(const RowSummary& summary);

 private:
  SamplingParams params_;
  uint64_t draws_ = 0;
};

int32_t argmax(std::span<const float> logits);

}  // namespace keel
