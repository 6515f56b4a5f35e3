// Speculative decoding on a GPU: model/speculative.h's SpeculativeTarget over a GpuModel
// and one sequence on it. The trunk's streams stay in device memory between the
// verification and the MTP layer; rows are summarized on the device by the plan's
// sampling kernels (the target's and the draft's), and only the summaries come back.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "cuda/gpu_model.h"
#include "model/speculative.h"

namespace keel::cuda {

class GpuSpeculativeTarget final : public SpeculativeTarget {
 public:
  // Error(usage) without an MTP layer. With expert parallelism, one per rank, called on
  // every rank at once (parallel/parallel_speculative.h).
  explicit GpuSpeculativeTarget(const GpuModel& model);
  const ModelConfig& config() const override { return model_.config(); }
  int64_t length() const override { return sequence_.length; }
  RowSummary prefill(std::span<const int32_t> prompt, const RowChoice& choice) override;
  RowSummary draft(std::span<const int32_t> next_tokens, const RowChoice& choice) override;
  RowSummary draft_more(int32_t token, const RowChoice& choice) override;
  void undo_drafts() override;
  std::vector<RowSummary> verify(std::span<const int32_t> tokens, std::span<const RowChoice> choices) override;
  void keep(int64_t keep) override;

 private:
  void use_device() const;
  const GpuModel& model_;
  DeviceSequence sequence_;
  DeviceBuffer<float> waiting_;   // trunk streams of the positions the MTP layer has not run
  DeviceBuffer<float> verified_;  // the last verify's (or the prompt's) streams
  DeviceBuffer<float> draft_streams_, draft_in_, first_streams_;  // last output, its input, draft()'s
  DeviceMark trunk_mark_, draft_mark_;
  DeviceJournal journal_;
  int64_t verified_tokens_ = 0;
};

}  // namespace keel::cuda
