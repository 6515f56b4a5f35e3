#include "model/speculative.h"

#include <algorithm>
#include <string>

#include "base/error.h"

namespace keel {

// --- The CPU's target ------------------------------------------------------------------

CpuSpeculativeTarget::CpuSpeculativeTarget(const Model& model) : model_(model), sequence_(model.new_sequence()) {
  if (!model.has_draft()) fail(ErrorCode::usage, {}, "speculative decoding needs a model with an MTP layer");
}

RowSummary CpuSpeculativeTarget::prefill(std::span<const int32_t> prompt, const RowChoice& choice) {
  return summarize_for(model_.forward(sequence_, prompt, LogitRows::last, {.streams = &waiting_}), choice);
}

RowSummary CpuSpeculativeTarget::draft(std::span<const int32_t> next_tokens, const RowChoice& choice) {
  const std::vector<float> logits = model_.draft(sequence_, waiting_, next_tokens, LogitRows::last, &draft_streams_);
  waiting_.clear();
  draft_mark_ = model_.mark_draft(sequence_, kMaxDraftTokens);
  first_streams_ = draft_streams_;
  return summarize_for(logits, choice);
}

RowSummary CpuSpeculativeTarget::draft_more(int32_t token, const RowChoice& choice) {
  const std::vector<float> in = std::move(draft_streams_);
  return summarize_for(model_.draft(sequence_, in, std::span(&token, 1), LogitRows::last, &draft_streams_), choice);
}

void CpuSpeculativeTarget::undo_drafts() {
  model_.rewind_draft(sequence_, draft_mark_);
  draft_streams_ = first_streams_;
}

std::vector<RowSummary> CpuSpeculativeTarget::verify(std::span<const int32_t> tokens,
                                                     std::span<const RowChoice> choices) {
  if (choices.size() != tokens.size()) fail(ErrorCode::usage, {}, "a verification needs one choice per token");
  trunk_mark_ = model_.mark(sequence_, static_cast<int64_t>(tokens.size()));
  verified_tokens_ = static_cast<int64_t>(tokens.size());
  const std::vector<float> logits =
      model_.forward(sequence_, tokens, LogitRows::all, {.streams = &verified_, .journal = &journal_});
  const auto V = static_cast<size_t>(config().vocab_size);
  std::vector<RowSummary> out;
  for (size_t i = 0; i < tokens.size(); ++i) out.push_back(summarize_for(std::span(logits).subspan(i * V, V), choices[i]));
  return out;
}

void CpuSpeculativeTarget::keep(int64_t keep) {
  if (keep < verified_tokens_) model_.rewind(sequence_, trunk_mark_, journal_, keep);
  const auto width = static_cast<int64_t>(verified_.size()) / verified_tokens_;
  waiting_.insert(waiting_.end(), verified_.begin(), verified_.begin() + keep * width);
}

// --- The decoder ---------------------------------------------------------------------------

SpeculativeDecoder::SpeculativeDecoder(SpeculativeTarget& target, int draft_tokens)
    : target_(target), draft_tokens_(draft_tokens) {
  if (draft_tokens < 1 || draft_tokens > kMaxDraftTokens || draft_tokens >= target.config().sliding_window) {
    fail(ErrorCode::usage, {.field = "--speculative"}, "draft tokens must be in 1 .. " + std::to_string(kMaxDraftTokens));
  }
}

namespace {

// The row choice for `sampler`'s draw `draw`.
RowChoice choice_at(const Sampler& sampler, uint64_t draw) { return {sampler.params(), draw, 1}; }

}  // namespace

int32_t SpeculativeDecoder::start(std::span<const int32_t> prompt, Sampler& sampler) {
  const int32_t first = sampler.next(target_.prefill(prompt, choice_at(sampler, sampler.draws())));
  waiting_tokens_.assign(prompt.begin() + 1, prompt.end());
  waiting_tokens_.push_back(first);
  return first;
}

std::vector<int32_t> SpeculativeDecoder::generate(std::span<const int32_t> prompt, int count, Sampler& sampler) {
  std::vector<int32_t> out{start(prompt, sampler)};
  while (static_cast<int>(out.size()) < count) {
    const std::vector<int32_t> more = step(sampler);
    out.insert(out.end(), more.begin(), more.end());
  }
  out.resize(static_cast<size_t>(std::max(count, 0)));
  return out;
}

std::vector<int32_t> SpeculativeDecoder::step(Sampler& sampler) {
  const ModelConfig& c = target_.config();
  const int32_t next = waiting_tokens_.back();
  // Near the end of the context, fewer drafts (none at the last position).
  const int k =
      static_cast<int>(std::clamp<int64_t>(c.max_position_embeddings - target_.length() - 1, 0, draft_tokens_));
  const uint64_t draw = sampler.draws();

  std::vector<int32_t> drafts;
  if (k > 0) {
    // The MTP layer catches up on the trunk's positions; its last row drafts the first
    // token, its own output the others (positions undone afterwards).
    // Each draft is the token the sampler would choose at its position's draw, without
    // taking the draw.
    const SamplingParams& p = sampler.params();
    drafts.push_back(choose(p, draw, target_.draft(waiting_tokens_, choice_at(sampler, draw))));
    for (int j = 1; j < k; ++j) {
      drafts.push_back(choose(p, draw + j, target_.draft_more(drafts.back(), choice_at(sampler, draw + j))));
    }
    target_.undo_drafts();
    waiting_tokens_.clear();
  }

  // One trunk forward over the next token and the drafts.
  std::vector<int32_t> run{next};
  run.insert(run.end(), drafts.begin(), drafts.end());
  std::vector<RowChoice> choices;
  for (size_t j = 0; j < run.size(); ++j) choices.push_back(choice_at(sampler, draw + j));
  const std::vector<RowSummary> rows = target_.verify(run, choices);
  std::vector<int32_t> out;
  for (size_t j = 0; j < run.size(); ++j) {
    out.push_back(sampler.next(rows[j]));  // row j was summarized for draw `draw + j`, the sampler's now
    if (j == drafts.size() || out.back() != drafts[j]) break;
  }
  const auto kept = static_cast<int64_t>(out.size());
  target_.keep(kept);
  waiting_tokens_.insert(waiting_tokens_.end(), out.begin(), out.end());
  stats_.steps++;
  stats_.drafted += static_cast<int64_t>(drafts.size());
  stats_.accepted += kept - 1;
  stats_.tokens += kept;
  return out;
}

}  // namespace keel
