// Speculative decoding over several GPUs: the MTP layer's routed experts are split like
// the trunk's, so every rank drafts and verifies at once (its MoE all-reduces meet) and
// rank 0's logits decide. Each rank keeps its own sequence and buffers
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
  std::vector<float> prefill(std::span<const int32_t> prompt) override;
  std::vector<float> draft(std::span<const int32_t> next_tokens) override;
  std::vector<float> draft_more(int32_t token) override;
  void undo_drafts() override;
  std::vector<float> verify(std::span<const int32_t> tokens) override;
  void keep(int64_t keep) override;

 private:
  // call(rank's target) on every rank at once; rank 0's logits.
  template <typename Call>
  std::vector<float> all(const Call& call);

  ExpertParallelModel& model_;
  std::vector<std::unique_ptr<cuda::GpuSpeculativeTarget>> ranks_;
};

}  // namespace keel::parallel
