// A DeepSeek-V4 model on one GPU: the forward pass of model/forward.cpp with every op
// run by the CUDA kernels the plan chose for the device's architecture, weights in
// device memory in their stored formats, and each sequence's state (sliding ring,
// compressed entries, indexer keys, open windows) in device memory. The CPU Model is
// the reference it is tested against (tests/gpu/test_gpu_model.cpp).
//
// Several sequences run as one batch: projections, experts, mHC and the head run over
// the rows of every chunk at once (each weight read once per step); attention and the
// indexer run in one launch over all rows, each row reading its own sequence's keys;
// compressors that close a window run per sequence.
//
// What is not here yet: tensor-core attention for prefill (the decode kernel runs per
// query token), CUDA graphs, paged state, and MTP.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/linear.h"
#include "cuda/rope.h"
#include "model/model.h"
#include "ops/sampling.h"
#include "plan/expert_split.h"

namespace keel::cuda {

// One compressor's state (model/sequence.h's CompressorState, on the device).
struct DeviceCompressorState {
  int64_t count = 0;  // entries made
  int pending = 0;    // rows of the open window
  DeviceBuffer<float> pending_kv, pending_gate;  // [pending, width], gate without bias
  DeviceBuffer<float> previous_kv, previous_gate;  // CSA: the last closed window's rows
  DeviceCompressorState copy() const;
};

struct DeviceLayerState {
  // Key rows of head_dim: [sliding_window ring | the running chunk | compressed entries].
  DeviceBuffer<float> keys;
  int64_t chunk_rows = 0, entry_rows = 0;  // capacities of the last two regions
  DeviceCompressorState compressor;
  DeviceCompressorState indexer;
  DeviceBuffer<float> index_keys;  // CSA: [indexer.count, index_head_dim]
  DeviceLayerState copy() const;
};

struct DeviceSequence {
  int64_t length = 0;
  std::vector<DeviceLayerState> layers;
  uint64_t state_bytes() const;  // device bytes held
};

// One sequence's part of a batched forward call: `tokens` run after what it holds.
struct DeviceChunk {
  DeviceSequence* sequence = nullptr;
  std::span<const int32_t> tokens;
};

// Expert parallelism (parallel/expert_parallel.h): which routed experts this model
// holds, and how the partial MoE outputs of all holders are summed. Every rank runs the
// same tokens through replicated attention; only the routed experts are split.
struct ExpertShare {
  int rank = 0;
  ExpertSplit split;  // which rank holds each routed expert; the shared expert runs on rank 0
  // Sums `count` floats in place across the ranks, on `stream` (null with one rank).
  std::function<void(float* data, int64_t count, cudaStream_t stream)> all_reduce;
  int ranks() const { return split.ranks; }
  bool holds(int64_t expert) const { return split.owner(expert) == rank; }
};

class GpuModel {
 public:
  // Plans for the architecture of CUDA device `device` (the user's choices as for the
  // CPU), checks the plan, then copies the model's weights to that device. Throws
  // Error(kernel_plan) for an impossible plan, Error(usage) for a GPU keel has no name
  // for or no code for, std::runtime_error for CUDA failures (out of memory).
  // With a `share` of several ranks, only that rank's routed experts are uploaded.
  static std::unique_ptr<GpuModel> create(const Model& model, int device = 0, const BackendChoices& target = {},
                                          const BackendChoices& draft = {}, ExpertShare share = {});
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const { return host_.config(); }
  const Plan& plan() const { return plan_; }
  const ExpertShare& share() const { return share_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

  DeviceSequence new_sequence() const;
  // An independent copy of `sequence` (every buffer), on this model's device.
  DeviceSequence clone(const DeviceSequence& sequence) const;

  // As Model::forward: runs `tokens` after what `sequence` holds and returns their
  // logits (copied to the host). Not safe to call from two threads at once.
  std::vector<float> forward(DeviceSequence& sequence, std::span<const int32_t> tokens,
                             LogitRows rows = LogitRows::all) const;
  // Several sequences in one call (each at most once), returning each chunk's logits.
  // Every chunk is checked before any state changes. The logits of a chunk are the
  // same, bit for bit, as when it runs alone: every kernel computes a row the same way
  // whatever the other rows are.
  std::vector<std::vector<float>> forward(std::span<const DeviceChunk> batch, LogitRows rows = LogitRows::all) const;
  // Several sequences in one call for choosing tokens (Executor::forward_choices): the
  // head runs only for the chunks with a choice, and their last rows are summarized on
  // the device by the planned sampling kernel, so only the summaries come back. A row
  // whose summary does not suffice (a top-p mass beyond the candidates), and every row
  // when the plan chose the host sampler, is copied back and summarized here.
  std::vector<std::optional<RowSummary>> forward(std::span<const DeviceChunk> batch,
                                                 std::span<const std::optional<RowChoice>> choices) const;

  // Time per stage of the forward pass, summed over the calls since profiling was
  // turned on (CUDA events around each stage; off by default: they cost ~1 us each).
  void set_profiling(bool on);
  const std::map<std::string, double>& profile() const { return profile_; }

  struct Layer;
  struct Kernels;
  struct Workspace;

 private:
  explicit GpuModel(const Model& host);  // in the .cpp, where the member types are complete
  // Runs the batch through the layers, then the head for the last head_rows[i] rows of
  // chunk i (0: none), leaving their logits in the workspace in chunk order; returns
  // how many rows that is. The stream is not synchronized.
  int64_t run(std::span<const DeviceChunk> batch, std::span<const int64_t> head_rows) const;
  // Copies `rows` rows of logits back and ends the call; the host pointer lives until
  // the next call.
  const float* copy_back_logits(int64_t rows) const;
  // Synchronizes the stream (the next call reuses the staging memory) and collects the
  // profile.
  void end_call() const;

  const Model& host_;
  Plan plan_;
  int device_ = 0;
  ExpertShare share_;
  cudaStream_t stream_ = nullptr;
  std::vector<DeviceWeight> owned_;  // every uploaded weight, released at the end
  uint64_t weight_bytes_ = 0;
  std::unique_ptr<Kernels> top_kernels_;
  std::vector<Kernels> layer_kernels_;
  std::vector<Layer> layers_;
  DeviceRope rope_main_{}, rope_compress_{};
  DeviceWeight embed_{}, head_{};
  DeviceBuffer<float> norm_, head_fn_, head_base_, head_scale_;
  std::unique_ptr<Workspace> work_;
  mutable std::map<std::string, double> profile_;
};

}  // namespace keel::cuda
