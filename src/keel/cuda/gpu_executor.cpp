#include "cuda/gpu_executor.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "cuda/device.h"
#include "cuda/speculative_target.h"

namespace keel::cuda {

uint64_t pool_bytes(const GpuModel& m, int64_t blocks) { return blocks * m.state_pool().block_bytes(); }

uint64_t pool_capacity(const GpuModel& m, uint64_t bytes) {
  return std::min<uint64_t>(bytes / m.state_pool().block_bytes(), INT64_MAX);
}

std::unique_ptr<SequenceState> GpuExecutor::new_sequence() const {
  auto s = std::make_unique<GpuSequence>();
  s->sequence = model_->new_sequence();
  return s;
}

std::unique_ptr<SequenceState> GpuExecutor::clone(const SequenceState& sequence) const {
  auto s = std::make_unique<GpuSequence>();
  s->sequence = model_->clone(static_cast<const GpuSequence&>(sequence).sequence);
  return s;
}

uint64_t GpuExecutor::state_in_use() const { return pool_bytes(*model_, model_->state_pool().used()); }

uint64_t GpuExecutor::state_growth(const SequenceState* sequence, int64_t tokens) const {
  return pool_bytes(*model_, sequence ? model_->blocks_needed(static_cast<const GpuSequence*>(sequence)->sequence, tokens)
                                      : model_->blocks_needed(model_->new_sequence(), tokens));
}

void GpuExecutor::limit_state(uint64_t bytes) const {
  model_->state_pool().set_capacity(static_cast<int64_t>(pool_capacity(*model_, bytes)));
}

std::vector<float> GpuExecutor::forward(SequenceState& sequence, std::span<const int32_t> tokens,
                                        LogitRows rows) const {
  return model_->forward(static_cast<GpuSequence&>(sequence).sequence, tokens, rows);
}

std::vector<std::vector<float>> GpuExecutor::forward_batch(std::span<const SequenceChunk> batch, LogitRows rows) const {
  return model_->forward(device_chunks(batch), rows);
}

std::vector<std::optional<RowSummary>> GpuExecutor::forward_choices(
    std::span<const SequenceChunk> batch, std::span<const std::optional<RowChoice>> choices) const {
  return model_->forward(device_chunks(batch), choices);
}

void GpuExecutor::begin_choices(std::span<const SequenceChunk> batch,
                                std::span<const std::optional<RowChoice>> choices) const {
  model_->begin(device_chunks(batch), choices);
}

std::string GpuExecutor::device() const { return fmt::format("cuda:{} ({})", index_, name_); }

std::unique_ptr<SpeculativeTarget> GpuExecutor::speculative_target() const {
  return std::make_unique<GpuSpeculativeTarget>(*model_);
}

double GpuExecutor::measure_bandwidth(uint64_t bytes) const { return copy_bandwidth(index_, bytes, 10); }

double GpuExecutor::measure_tensor_throughput() const { return mma_bf16_throughput(index_, 5); }

std::optional<Executor::Memory> GpuExecutor::device_memory() const {
  const MemoryInfo m = memory_info(index_);
  return Memory{m.free, m.total};
}

std::string GpuExecutor::decode_graphs() const {
  const DecodeGraphCounts c = model_->decode_graph_counts();
  if (!c.failure.empty()) return "off after a capture failed (" + c.failure + "); steps launch kernel by kernel";
  if (!c.on) return "off (--eager)";
  return fmt::format("on: {} steps made graphs, {} steps ran updated ones", c.captured, c.replayed);
}

std::vector<DeviceChunk> GpuExecutor::device_chunks(std::span<const SequenceChunk> batch) {
  std::vector<DeviceChunk> chunks;
  for (const SequenceChunk& c : batch) {
    chunks.push_back({&static_cast<GpuSequence*>(c.sequence)->sequence, c.tokens, c.pick_of});
  }
  return chunks;
}

}  // namespace keel::cuda
