// DeepSeek-V4 over several GPUs of one host: expert parallelism for the MoE layers,
// attention replicated (docs/multi-gpu.md says why), NCCL between the ranks.
//
// One process drives every GPU of its host, one thread per GPU during a forward call:
// the host model, tokenizer and server stay single, and NCCL sees the usual
// one-rank-per-GPU layout (ncclCommInitRank on a unique id). Several hosts run one
// process each with the same command; only how the unique id reaches them differs.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/gpu_model.h"

namespace keel::parallel {

class ExpertParallelModel {
 public:
  // Uploads the model to this host's GPUs: every rank holds attention, the shared expert
  // (run by rank 0), embedding and head; routed expert e lives on rank e % world. Plans
  // each rank for its GPU's architecture (they must match). Throws Error(usage) for
  // fewer GPUs than asked or a bad id file, std::runtime_error for CUDA / NCCL failures.
  static std::unique_ptr<ExpertParallelModel> create(const Model& model, const Ranks& ranks,
                                                     const BackendChoices& target = {}, const BackendChoices& draft = {});
  // All ranks on this host's GPUs 0..gpus-1.
  static std::unique_ptr<ExpertParallelModel> create(const Model& model, int gpus, const BackendChoices& target = {},
                                                     const BackendChoices& draft = {}) {
    return create(model, Ranks{.gpus = gpus}, target, draft);
  }
  ~ExpertParallelModel();

  struct Sequence {
    std::vector<cuda::DeviceSequence> ranks;
    int64_t length() const { return ranks.front().length; }
  };
  Sequence new_sequence() const;

  // As Model::forward; every rank runs the tokens, this host's first rank's logits are
  // returned (every rank computes the same ones: the MoE sums are all-reduced).
  std::vector<float> forward(Sequence& sequence, std::span<const int32_t> tokens, LogitRows rows = LogitRows::all);
  // As GpuModel's batched forward, on every rank.
  struct Chunk {
    Sequence* sequence = nullptr;
    std::span<const int32_t> tokens;
  };
  std::vector<std::vector<float>> forward(std::span<const Chunk> batch, LogitRows rows = LogitRows::all);
  // GpuModel's forward for choosing tokens, on every rank; rank 0's summaries.
  std::vector<std::optional<RowSummary>> forward(std::span<const Chunk> batch,
                                                 std::span<const std::optional<RowChoice>> choices);

  // This host's ranks; rank(r) below is the r-th of them.
  int gpus() const { return static_cast<int>(ranks_.size()); }
  const Ranks& ranks() const { return where_; }
  // Runs call(rank) for every rank of this host at once, one thread each (their collectives meet),
  // and rethrows the first failure.
  void each_rank(const std::function<void(int rank)>& call);
  cuda::GpuModel& rank(int r) { return *ranks_[r]; }
  const cuda::GpuModel& rank(int r) const { return *ranks_[r]; }
  const Plan& plan() const { return ranks_.front()->plan(); }
  uint64_t weight_bytes(int rank) const { return ranks_[rank]->weight_bytes(); }
  // The split (ExpertSplit::describe) and each rank's weight bytes.
  std::string layout() const;

  // Seconds this host's first rank spent in the MoE all-reduces (waiting for the other ranks included)
  // since the last reset, measured with CUDA events around each call.
  double communication_seconds() const { return comm_seconds_; }
  void reset_communication_time() { comm_seconds_ = 0; }

  // The floor: seconds per all-reduce of `floats` f32 values across the ranks, best
  // mean over `iterations` back-to-back calls timed with CUDA events on the first
  // rank's stream, measured now on the same communicators (every host must call it).
  double all_reduce_seconds(int64_t floats, int iterations);

  struct Comms;

 private:
  ExpertParallelModel() = default;
  // call(rank's model, the batch's chunks of that rank) through each_rank; rank 0's result.
  template <typename Result, typename Call>
  Result on_every_rank(std::span<const Chunk> batch, const Call& call);
  std::vector<std::unique_ptr<cuda::GpuModel>> ranks_;
  Ranks where_;
  std::unique_ptr<Comms> comms_;
  double comm_seconds_ = 0;
};

}  // namespace keel::parallel
