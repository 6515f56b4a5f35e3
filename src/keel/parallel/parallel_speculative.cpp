#include "parallel/parallel_speculative.h"

namespace keel::parallel {

ParallelSpeculativeTarget::ParallelSpeculativeTarget(ExpertParallelModel& model) : model_(model) {
  for (int r = 0; r < model.gpus(); ++r) ranks_.push_back(std::make_unique<cuda::GpuSpeculativeTarget>(model.rank(r)));
}

template <typename Call>
auto ParallelSpeculativeTarget::all(const Call& call) {
  std::vector<decltype(call(*ranks_.front()))> results(ranks_.size());
  model_.each_rank([&](int r) { results[r] = call(*ranks_[r]); });
  return std::move(results.front());
}

RowSummary ParallelSpeculativeTarget::prefill(std::span<const int32_t> prompt, const RowChoice& choice) {
  return all([&](SpeculativeTarget& t) { return t.prefill(prompt, choice); });
}

RowSummary ParallelSpeculativeTarget::draft(std::span<const int32_t> next_tokens, const RowChoice& choice) {
  return all([&](SpeculativeTarget& t) { return t.draft(next_tokens, choice); });
}

RowSummary ParallelSpeculativeTarget::draft_more(int32_t token, const RowChoice& choice) {
  return all([&](SpeculativeTarget& t) { return t.draft_more(token, choice); });
}

void ParallelSpeculativeTarget::undo_drafts() {
  all([](SpeculativeTarget& t) {
    t.undo_drafts();
    return 0;
  });
}

std::vector<RowSummary> ParallelSpeculativeTarget::verify(std::span<const int32_t> tokens,
                                                          std::span<const RowChoice> choices) {
  return all([&](SpeculativeTarget& t) { return t.verify(tokens, choices); });
}

void ParallelSpeculativeTarget::keep(int64_t keep) {
  all([&](SpeculativeTarget& t) {
    t.keep(keep);
    return 0;
  });
}

}  // namespace keel::parallel
