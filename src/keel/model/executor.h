// An executor runs a loaded model's forward passes on the device that holds it, as the
// server engine and the commands drive it: sequences are opaque states of that device
// (model/sequence.h on the CPU, cuda::DeviceSequence on a GPU). CpuExecutor is the
// CPU's; cli/runner.cpp builds the GPU ones from --device and --gpus.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/speculative.h"
#include "ops/sampling.h"

namespace keel {

class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual int64_t length() const = 0;  // tokens processed
  virtual uint64_t bytes() const = 0;   // state held (host or device memory)
};

// One sequence's part of a batched forward: `tokens` run after what it holds.
struct SequenceChunk {
  SequenceState* sequence = nullptr;
  std::span<const int32_t> tokens;
  // >= 0 (Executor::begin_choices, tokens empty): one token, the choice of chunk
  // `pick_of` of the call begun just before.
  int pick_of = -1;
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::unique_ptr<SequenceState> new_sequence() const = 0;
  // An independent copy of `sequence` (from this executor): every part of its state.
  virtual std::unique_ptr<SequenceState> clone(const SequenceState& sequence) const = 0;
  // Model::forward on `sequence`, which must come from this executor's new_sequence.
  // Not safe to call from two threads at once.
  virtual std::vector<float> forward(SequenceState& sequence, std::span<const int32_t> tokens,
                                     LogitRows rows = LogitRows::all) const = 0;
  // Several sequences' chunks in one call (each sequence at most once); returns each
  // chunk's logits, the same as forward() on it alone. This one runs them one after
  // another; the CPU and GPU executors run them as one batch, reading each weight once.
  virtual std::vector<std::vector<float>> forward_batch(std::span<const SequenceChunk> batch,
                                                        LogitRows rows = LogitRows::all) const;
  // A batched forward for choosing tokens: each chunk's last row reduced to what
  // choose() needs (ops/sampling.h), for the chunks with a choice; the others (a
  // prompt's middle chunks) get no logits at all. This one summarizes forward_batch's
  // rows on the host; the GPU executors summarize on the device, so only the summaries
  // come back.
  virtual std::vector<std::optional<RowSummary>> forward_choices(std::span<const SequenceChunk> batch,
                                                                 std::span<const std::optional<RowChoice>> choices) const;
  // Pipelined decode (vLLM's async scheduling): begin_choices enqueues forward_choices'
  // call and may return before it has run; finish_choices returns the oldest begun
  // call's summaries. A chunk may take its one token from chunk `pick_of` of the call
  // begun just before (SequenceChunk::pick_of) where that chunk's choice needs no host
  // (ops/sampling.h's PickKind; Error(usage) otherwise): a GPU picks it on the device,
  // so step n + 1 is enqueued while step n runs and each token is read a step late. At
  // most two calls are begun and not finished; every other call needs none. This one
  // runs the call at once and picks on the host: the same tokens, no overlap.
  virtual void begin_choices(std::span<const SequenceChunk> batch,
                             std::span<const std::optional<RowChoice>> choices) const;
  virtual std::vector<std::optional<RowSummary>> finish_choices() const;
  // Whether a chunk of the next begun call may take its token from a chunk chosen with
  // `params` (pick_of): ops/sampling.h's PickKind here; a GPU also needs its sampling
  // kernel planned.
  virtual bool picks(const SamplingParams& params) const { return pick_kind(params) != PickKind::candidates; }
  virtual const Plan& plan() const = 0;
  virtual std::string device() const = 0;  // "cpu (16 threads)", "cuda:0 (NVIDIA H200)"

  // Sequence state (docs/serve.md), in bytes: what every live sequence of this executor
  // holds (copies and prefix snapshots included), and at most how much running `tokens`
  // more on `sequence` (null: a fresh one) adds to it. On the CPU the state is paged
  // (model/block_pool.h): blocks shared by copies count once, and both figures are
  // block counts. On a GPU they count each sequence's device buffers.
  virtual uint64_t state_in_use() const = 0;
  virtual uint64_t state_growth(const SequenceState* sequence, int64_t tokens) const = 0;
  // The most state this executor may hold: past it, allocation fails with
  // Error(out_of_memory) (the CPU's pool; a GPU's buffers have no such limit).
  virtual void limit_state(uint64_t /*bytes*/) const {}
  // Speculative decoding's view of the model and a fresh sequence on this device
  // (model/speculative.h); Error(usage) where there is none (no MTP layer, several GPUs).
  virtual std::unique_ptr<SpeculativeTarget> speculative_target() const;

  // The bandwidth a decode step is held to on this device, bytes/s, measured now over a
  // buffer of `bytes`: CPU read bandwidth, GPU device-to-device copy bandwidth.
  virtual double measure_bandwidth(uint64_t bytes) const = 0;
  // Dense bf16 tensor throughput measured now, FLOP/s (GPUs; 0 where there is none).
  virtual double measure_tensor_throughput() const { return 0; }
  // GPUs: the device memory now, after the weights (with several GPUs, the least free
  // of any); nothing on the CPU, whose state budget is given in bytes.
  struct Memory {
    uint64_t free = 0, total = 0;
  };
  virtual std::optional<Memory> device_memory() const { return std::nullopt; }
  // Several GPUs: seconds spent in communication since the last reset (0 otherwise),
  // and the floor measured now: seconds of one all-reduce of `floats` values.
  virtual void reset_communication() {}
  virtual double communication_seconds() const { return 0; }
  virtual double all_reduce_floor(int64_t /*floats*/) { return 0; }
  // GPUs: seconds per stage of the forward pass, summed over the calls since profiling
  // was turned on (rank 0's with several GPUs); empty where there is no profile.
  virtual void set_profiling(bool /*on*/) {}
  virtual std::map<std::string, double> profile() const { return {}; }
  // One GPU: how its decode steps used CUDA graphs, a line for reports; empty elsewhere.
  virtual std::string decode_graphs() const { return {}; }

 private:
  // The default begin_choices' calls, run and not yet finished: their choices (for the
  // next call's picks) and summaries.
  struct Ran {
    std::vector<std::optional<RowChoice>> choices;
    std::vector<std::optional<RowSummary>> summaries;
  };
  mutable std::vector<Ran> ran_;
};

class CpuExecutor final : public Executor {
 public:
  // Sequences take state blocks from a pool of this executor's own.
  explicit CpuExecutor(const Model& model);
  std::unique_ptr<SequenceState> new_sequence() const override;
  std::unique_ptr<SequenceState> clone(const SequenceState& sequence) const override;
  std::vector<float> forward(SequenceState& sequence, std::span<const int32_t> tokens,
                             LogitRows rows) const override;
  // Model's batched forward: every chunk's bits as alone, each weight read once a call.
  std::vector<std::vector<float>> forward_batch(std::span<const SequenceChunk> batch, LogitRows rows) const override;
  // The same with a head row only for the chunks with a choice, summarized here.
  std::vector<std::optional<RowSummary>> forward_choices(std::span<const SequenceChunk> batch,
                                                         std::span<const std::optional<RowChoice>> choices) const override;
  const Plan& plan() const override { return model_.plan(); }
  std::string device() const override;
  uint64_t state_in_use() const override;
  uint64_t state_growth(const SequenceState* sequence, int64_t tokens) const override;
  void limit_state(uint64_t bytes) const override;
  std::unique_ptr<SpeculativeTarget> speculative_target() const override {
    return std::make_unique<CpuSpeculativeTarget>(model_);
  }
  double measure_bandwidth(uint64_t bytes) const override;

 private:
  std::vector<std::vector<float>> run(std::span<const SequenceChunk> batch, std::span<const int64_t> head_rows) const;
  const Model& model_;
  std::shared_ptr<HostBlockPool> pool_;
};

}  // namespace keel
