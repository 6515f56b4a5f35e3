#include "cuda/speculative_target.h"

#include <cuda_runtime_api.h>

#include "base/error.h"

namespace keel::cuda {
namespace {

void copy_streams(DeviceBuffer<float>& to, const DeviceBuffer<float>& from) {
  to.resize(from.size());
  check_api(cudaMemcpy(to.data(), from.data(), from.size() * sizeof(float), cudaMemcpyDeviceToDevice), "cudaMemcpy");
}

}  // namespace

// Every buffer of the target lives on its model's GPU, whichever thread calls.
void GpuSpeculativeTarget::use_device() const { check_api(cudaSetDevice(model_.device()), "cudaSetDevice"); }

GpuSpeculativeTarget::GpuSpeculativeTarget(const GpuModel& model) : model_(model), sequence_(model.new_sequence()) {
  if (!model.has_draft()) fail(ErrorCode::usage, {}, "speculative decoding needs a model with an MTP layer");
}

RowSummary GpuSpeculativeTarget::prefill(std::span<const int32_t> prompt, const RowChoice& choice) {
  use_device();
  // The prompt's streams all wait for the MTP layer; only its last row is summarized.
  RowSummary last = std::move(model_.verify(sequence_, prompt, std::span(&choice, 1), verified_, nullptr).front());
  verified_tokens_ = static_cast<int64_t>(prompt.size());
  keep(verified_tokens_);
  return last;
}

RowSummary GpuSpeculativeTarget::draft(std::span<const int32_t> next_tokens, const RowChoice& choice) {
  use_device();
  RowSummary last = model_.draft(sequence_, waiting_.data(), next_tokens, choice, draft_streams_);
  waiting_.resize(0);
  model_.mark_draft(sequence_, kMaxDraftTokens, draft_mark_);
  copy_streams(first_streams_, draft_streams_);
  return last;
}

RowSummary GpuSpeculativeTarget::draft_more(int32_t token, const RowChoice& choice) {
  use_device();
  std::swap(draft_in_, draft_streams_);
  return model_.draft(sequence_, draft_in_.data(), std::span(&token, 1), choice, draft_streams_);
}

void GpuSpeculativeTarget::undo_drafts() {
  use_device();
  model_.rewind_draft(sequence_, draft_mark_);
  copy_streams(draft_streams_, first_streams_);
}

std::vector<RowSummary> GpuSpeculativeTarget::verify(std::span<const int32_t> tokens,
                                                     std::span<const RowChoice> choices) {
  if (choices.size() != tokens.size()) fail(ErrorCode::usage, {}, "a verification needs one choice per token");
  use_device();
  model_.mark(sequence_, static_cast<int64_t>(tokens.size()), trunk_mark_);
  verified_tokens_ = static_cast<int64_t>(tokens.size());
  return model_.verify(sequence_, tokens, choices, verified_, &journal_);
}

void GpuSpeculativeTarget::keep(int64_t keep) {
  use_device();
  if (keep < verified_tokens_) model_.rewind(sequence_, trunk_mark_, journal_, keep);
  const int64_t width = static_cast<int64_t>(verified_.size()) / verified_tokens_;
  const size_t at = waiting_.size();
  waiting_.resize(at + static_cast<size_t>(keep * width));
  check_api(cudaMemcpy(waiting_.data() + at, verified_.data(), keep * width * sizeof(float), cudaMemcpyDeviceToDevice),
            "cudaMemcpy");
}

}  // namespace keel::cuda
