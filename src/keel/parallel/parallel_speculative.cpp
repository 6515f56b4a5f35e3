#include "parallel/parallel_speculative.h"

namespace keel::parallel {

ParallelSpeculativeTarget::ParallelSpeculativeTarget(ExpertParallelModel& model) : model_(model) {
  for (int r = 0; r < model.gpus(); ++r) ranks_.push_back(std::make_unique<cuda::GpuSpeculativeTarget>(model.rank(r)));
}

template <typename Call>
std::vector<float> ParallelSpeculativeTarget::all(const Call& call) {
  std::vector<std::vector<float>> logits(ranks_.size());
  model_.each_rank([&](int r) { logits[r] = call(*ranks_[r]); });
  return std::move(logits.front());
}

std::vector<float> ParallelSpeculativeTarget::prefill(std::span<const int32_t> prompt) {
  return all([&](SpeculativeTarget& t) { return t.prefill(prompt); });
}

std::vector<float> ParallelSpeculativeTarget::draft(std::span<const int32_t> next_tokens) {
  return all([&](SpeculativeTarget& t) { return t.draft(next_tokens); });
}

std::vector<float> ParallelSpeculativeTarget::draft_more(int32_t token) {
  return all([&](SpeculativeTarget& t) { return t.draft_more(token); });
}

void ParallelSpeculativeTarget::undo_drafts() {
  all([](SpeculativeTarget& t) {
    t.undo_drafts();
    return std::vector<float>{};
  });
}

std::vector<float> ParallelSpeculativeTarget::verify(std::span<const int32_t> tokens) {
  return all([&](SpeculativeTarget& t) { return t.verify(tokens); });
}

void ParallelSpeculativeTarget::keep(int64_t keep) {
  all([&](SpeculativeTarget& t) {
    t.keep(keep);
    return std::vector<float>{};
  });
}

}  // namespace keel::parallel
