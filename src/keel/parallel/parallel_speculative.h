// Speculative decoding over several GPUs: the MTP layer's routed experts are split like
// the trunk's, so every rank drafts and verifies at once (its MoE all-reduces meet) and
// the first rank's summaries decide (every rank computes the same logits). Each rank keeps its own sequence and buffers
// (cuda::GpuSpeculativeTarget).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "cuda/speculative_target.h"
#include "parallel/expert_parallel.h"

namespace keel::parallel {

class ParallelSpeculativeTarget final : public SpeculativeTarget {
 public:
  explicit ParallelSpeculativeTarget(ExpertParallelModel& model);
  const ModelConfig& config() const override { return ranks_.front()->config(); }
  int64_t length() const override { return ranks_.front()->length(); }
  RowSummary prefill(std::span<const int32_t> prompt, const RowChoice& choice) override;
  RowSummary draft(std::span<const int32_t> next_tokens, const RowChoice& choice) override;
  RowSummary draft_more(int32_t token, const RowChoice& choice) override;
  void undo_drafts() override;
  std::vector<RowSummary> verify(std::span<const int32_t> tokens, std::span<const RowChoice> choices) override;
  void keep(int64_t keep) override;

 private:
  // call(rank's target) on every rank at once; the first rank's result.
  template <typename Call>
  auto all(const Call& call);

  ExpertParallelModel& model_;
  std::vector<std::unique_ptr<cuda::GpuSpeculativeTarget>> ranks_;
};

}  // namespace keel::parallel
