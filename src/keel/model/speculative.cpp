#include "model/speculative.h"

#include <algorithm>

#include "base/error.h"

namespace keel {
namespace {

// The token `sampler` would choose at draw `draw` from `logits`, without taking the draw.
int32_t would_choose(const Sampler& sampler, uint64_t draw, std::span<const float> logits) {
  return choose(sampler.params(), draw, summarize_for(logits, {sampler.params(), draw, 1}));
}

}  // namespace

SpeculativeDecoder::SpeculativeDecoder(const Model& model, int draft_tokens)
    : model_(model), draft_tokens_(draft_tokens) {
  if (!model.has_draft()) fail(ErrorCode::usage, {}, "speculative decoding needs a model with an MTP layer");
  if (draft_tokens < 1 || draft_tokens > kMaxDraftTokens || draft_tokens >= model.config().sliding_window) {
    fail(ErrorCode::usage, {.field = "--speculative"}, "draft tokens must be in 1 .. " + std::to_string(kMaxDraftTokens));
  }
}

int32_t SpeculativeDecoder::start(Sequence& seq, std::span<const int32_t> prompt, Sampler& sampler) {
  const int64_t V = model_.config().vocab_size;
  const std::vector<float> logits = model_.forward(seq, prompt, LogitRows::last, {.streams = &streams_});
  const int32_t first = sampler.next(std::span(logits).subspan(0, V));
  tokens_.assign(prompt.begin() + 1, prompt.end());
  tokens_.push_back(first);
  return first;
}

std::vector<int32_t> SpeculativeDecoder::step(Sequence& seq, Sampler& sampler) {
  const ModelConfig& c = model_.config();
  const int64_t V = c.vocab_size, L = seq.length;
  const int32_t next = tokens_.back();
  // Near the end of the context, fewer drafts (none at the last position).
  const int k = static_cast<int>(std::clamp<int64_t>(c.max_position_embeddings - L - 1, 0, draft_tokens_));
  const uint64_t draw = sampler.draws();

  std::vector<int32_t> drafts;
  if (k > 0) {
    // The MTP layer catches up on the trunk's positions; its last row drafts the first token.
    std::vector<float> y;
    std::vector<float> logits = model_.draft(seq, streams_, tokens_, LogitRows::last, &y);
    drafts.push_back(would_choose(sampler, draw, logits));
    // Further drafts from its own output streams, at positions undone afterwards.
    const SequenceMark mark = model_.mark_draft(seq, k - 1);
    for (int j = 1; j < k; ++j) {
      logits = model_.draft(seq, y, std::span(&drafts.back(), 1), LogitRows::last, &y);
      drafts.push_back(would_choose(sampler, draw + j, logits));
    }
    model_.rewind_draft(seq, mark);
    streams_.clear();
    tokens_.clear();
  }

  // One trunk forward over the next token and the drafts.
  std::vector<int32_t> run{next};
  run.insert(run.end(), drafts.begin(), drafts.end());
  const SequenceMark mark = model_.mark(seq, static_cast<int64_t>(run.size()));
  ForwardJournal journal;
  std::vector<float> streams;
  const std::vector<float> logits = model_.forward(seq, run, LogitRows::all, {.streams = &streams, .journal = &journal});
  std::vector<int32_t> out;
  for (size_t j = 0; j < run.size(); ++j) {
    out.push_back(sampler.next(std::span(logits).subspan(j * V, V)));
    if (j == drafts.size() || out.back() != drafts[j]) break;
  }
  const auto keep = static_cast<int64_t>(out.size());
  if (keep < static_cast<int64_t>(run.size())) model_.rewind(seq, mark, journal, keep);

  // The kept positions' streams and the tokens after them wait for the MTP layer.
  const int64_t width = static_cast<int64_t>(streams.size()) / static_cast<int64_t>(run.size());
  streams_.insert(streams_.end(), streams.begin(), streams.begin() + keep * width);
  tokens_.insert(tokens_.end(), out.begin(), out.end());
  stats_.steps++;
  stats_.drafted += static_cast<int64_t>(drafts.size());
  stats_.accepted += keep - 1;
  stats_.tokens += keep;
  return out;
}

}  // namespace keel
