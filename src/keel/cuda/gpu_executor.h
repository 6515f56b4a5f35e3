// A GpuModel as an Executor (model/executor.h): what keel run, bench and serve drive on
// one GPU, and what the GPU tests give the serving engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/gpu_model.h"
#include "model/executor.h"

namespace keel::cuda {

// The executor's side of a GPU's paged state pool (cuda/device_block_pool.h): blocks as
// bytes, and the blocks a byte budget holds.
uint64_t pool_bytes(const GpuModel& m, int64_t blocks);
uint64_t pool_capacity(const GpuModel& m, uint64_t bytes);

struct GpuSequence final : SequenceState {
  DeviceSequence sequence;
  int64_t length() const override { return sequence.length; }
  uint64_t bytes() const override { return sequence.state_bytes(); }
};

class GpuExecutor final : public Executor {
 public:
  GpuExecutor(std::unique_ptr<GpuModel> model, int device, std::string name)
      : model_(std::move(model)), index_(device), name_(std::move(name)) {}
  std::unique_ptr<SequenceState> new_sequence() const override;
  std::unique_ptr<SequenceState> clone(const SequenceState& sequence) const override;
  uint64_t state_in_use() const override;
  uint64_t state_growth(const SequenceState* sequence, int64_t tokens) const override;
  void limit_state(uint64_t bytes) const override;
  std::vector<float> forward(SequenceState& sequence, std::span<const int32_t> tokens, LogitRows rows) const override;
  std::vector<std::vector<float>> forward_batch(std::span<const SequenceChunk> batch, LogitRows rows) const override;
  std::vector<std::optional<RowSummary>> forward_choices(
      std::span<const SequenceChunk> batch, std::span<const std::optional<RowChoice>> choices) const override;
  void begin_choices(std::span<const SequenceChunk> batch,
                     std::span<const std::optional<RowChoice>> choices) const override;
  std::vector<std::optional<RowSummary>> finish_choices() const override { return model_->finish(); }
  bool picks(const SamplingParams& params) const override { return model_->picks(params); }
  const Plan& plan() const override { return model_->plan(); }
  std::string device() const override;
  std::unique_ptr<SpeculativeTarget> speculative_target() const override;
  double measure_bandwidth(uint64_t bytes) const override;
  double measure_tensor_throughput() const override;
  std::optional<Memory> device_memory() const override;
  void set_profiling(bool on) override { model_->set_profiling(on); }
  std::map<std::string, double> profile() const override { return model_->profile(); }
  std::string decode_graphs() const override;

 private:
  static std::vector<DeviceChunk> device_chunks(std::span<const SequenceChunk> batch);

  std::unique_ptr<GpuModel> model_;
  int index_;
  std::string name_;
};

}  // namespace keel::cuda
