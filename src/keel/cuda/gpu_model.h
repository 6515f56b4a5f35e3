// A DeepSeek-V4 model on one GPU: the forward pass of model/forward.cpp with every op
// run by the CUDA kernels the plan chose for the device's architecture, weights in
// device memory in their stored formats, and each sequence's state (sliding ring,
// compressed entries, indexer keys, open windows) in the blocks of a device pool
// (cuda/device_block_pool.h), reached by the kernels through block tables. The CPU
// Model is the reference it is tested against (tests/gpu/test_gpu_model.cpp).
//
// Several sequences run as one batch: projections, experts, mHC and the head run over
// the rows of every chunk at once (each weight read once per step); attention and the
// indexer run in one launch over all rows, each row reading its own sequence's keys
// (its ring, its chunk's keys in place, its entries) through a block table;
// compressor windows that close in the step are pooled for all sequences at once.
//
// The MTP layer runs after the trunk's layers as a draft-role layer (draft, verify,
// mark/rewind for speculative decoding, cuda/speculative_target.h).
//
// Attention takes a kernel per kind of chunk (the plan's attention_prefill for chunks of
// several tokens, attention_decode for one, attention_verify for a verification's drafts),
// so a row's result never depends on what else is in the call.
//
// Decode steps (one token per sequence, up to 256 sequences) run as a few CUDA graphs
// each, per batch-size bucket: the layers in pieces of 1, 2, 4, 8, ... layers (one piece
// for a step begun while the call before runs), each piece's attention cores planned
// first, its launches captured and the executable graph of its bucket, piece and shape
// updated to them (DecodeGraphs in the .cpp). Steps may be pipelined (begin, finish):
// the next step is enqueued while this one runs, its tokens picked on the device.
//
// What is not here yet: tensor-core attention for decode and verify, and speculation
// inside the batched engine (which pipelines its decode steps through begin and finish).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/device_block_pool.h"
#include "cuda/device_buffer.h"
#include "cuda/linear.h"
#include "cuda/rope.h"
#include "model/model.h"
#include "ops/sampling.h"
#include "plan/expert_split.h"

namespace keel::cuda {

// One compressor's state (model/sequence.h's CompressorState, on the device). Every row
// array lives in the model's paged state pool (cuda/device_block_pool.h): copies share
// blocks until one side writes.
struct DeviceCompressorState {
  int64_t count = 0;  // entries made
  int pending = 0;    // rows of the open window
  DevicePagedRows pending_kv, pending_gate;    // [ratio, width] once used: the open window's rows, gate without bias
  DevicePagedRows previous_kv, previous_gate;  // CSA: [ratio, width], the last closed window's rows
};

struct DeviceLayerState {
  DevicePagedRows ring;     // [sliding_window, head_dim] once used: position p in slot p % sliding_window
  DevicePagedRows entries;  // compressed entries, [compressor.count, head_dim]
  DeviceCompressorState compressor;
  DeviceCompressorState indexer;
  DevicePagedRows index_keys;  // CSA: [indexer.count, index_head_dim]
};

struct DeviceSequence {
  int64_t length = 0;
  // The trunk's layers, then (with an MTP layer) the MTP block's own sliding-window state,
  // which has run `draft_length` positions (Model's Sequence::draft).
  std::vector<DeviceLayerState> layers;
  int64_t draft_length = 0;
  uint64_t state_bytes() const;  // bytes of the blocks held (shared ones counted in each holder)
};

// A verification's compressor inputs per trunk layer (kv, gate of the compressor, then of
// the indexer's), which GpuModel::rewind replays for the tokens kept (model.h's
// ForwardJournal).
struct DeviceJournal {
  std::vector<std::array<DeviceBuffer<float>, 4>> layers;
};

// What rewinding needs (model/sequence.h's SequenceMark, on the device): the ring rows
// the next tokens overwrite and each compressor's open window, carry and count (its rows
// kept by sharing their blocks).
struct DeviceMark {
  struct Layer {
    DeviceBuffer<float> ring;  // the rows of positions [length, length + ahead)
    bool ring_empty = false;
    DeviceCompressorState compressor, indexer;
  };
  int64_t length = 0, ahead = 0;
  std::vector<Layer> layers;
};

// One sequence's part of a batched forward call: `tokens` run after what it holds.
struct DeviceChunk {
  DeviceSequence* sequence = nullptr;
  std::span<const int32_t> tokens;
  // >= 0 (GpuModel::begin, tokens empty): one token, the choice of chunk `pick_of` of the
  // call begun just before, taken on the device without first coming back.
  int pick_of = -1;
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

// How decode steps used their CUDA graphs since graphs were last turned on.
struct DecodeGraphCounts {
  bool on = true;        // set_decode_graphs's; false after a failed capture
  int64_t captured = 0;  // steps that made an executable graph (a piece's first of a shape; again after a regrowth)
  int64_t replayed = 0;  // steps whose every piece ran as an executable graph updated to it
  std::string failure;   // why graphs turned themselves off (a capture failed), if they did
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
  int device() const { return device_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

  DeviceSequence new_sequence() const;
  // An independent copy of `sequence` (every buffer), on this model's device.
  DeviceSequence clone(const DeviceSequence& sequence) const;  // shares its blocks
  // The pool every sequence of this model takes its state blocks from.
  DeviceBlockPool& state_pool() const { return *pool_; }
  // At most how many blocks a forward of `tokens` more on `sequence` takes from the pool
  // (new rows, and copies of shared blocks it writes): what the serving engine keeps free
  // before a step (Model::blocks_needed on the CPU).
  int64_t blocks_needed(const DeviceSequence& sequence, int64_t tokens) const;

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

  // --- Pipelined decode (vLLM's async scheduling) ---
  // begin enqueues the call forward(batch, choices) makes and returns before the device
  // has run it; finish waits for the oldest begun call and returns its summaries. A
  // chunk of the next call may take its token from a chunk of this one (pick_of) whose
  // choice needs no host (ops/sampling.h's PickKind): the device picks it, so the host
  // enqueues step n + 1 while step n runs and reads each token a step late. A call with
  // a draw among candidates is finished at the next begin (its rows may need the logits
  // again). At most two calls are begun and not finished; every other call of this model
  // needs none (Error(usage) otherwise).
  void begin(std::span<const DeviceChunk> batch, std::span<const std::optional<RowChoice>> choices) const;
  std::vector<std::optional<RowSummary>> finish() const;
  // Whether a chunk chosen with `params` can be picked from (the sampling kernel planned,
  // and no draw among candidates).
  bool picks(const SamplingParams& params) const;

  // --- The MTP layer and speculative decoding (model.h's counterparts) ---
  bool has_draft() const { return has_draft_; }
  // Model::draft: the MTP layer at positions draft_length .. + n − 1, row i from
  // `streams` ([n, hc, D], device memory) and next_tokens[i]; the last row's logits
  // summarized for `choice` by the draft's planned sampling kernel (as forward's rows),
  // its output streams into `out_streams` ([hc, D], device).
  RowSummary draft(DeviceSequence& sequence, const float* streams, std::span<const int32_t> next_tokens,
                   const RowChoice& choice, DeviceBuffer<float>& out_streams) const;
  // A verification: `tokens` on one sequence, the last choices.size() rows summarized
  // for them (as forward's rows), every row's streams into `streams` ([n, hc, D],
  // device), and with a journal the compressors' inputs. With a journal the tokens are
  // drafts and attend through the planned verify kernel (the decode kernel's bits);
  // without one they are a prompt whose streams a draft needs, and attend as a prefill.
  std::vector<RowSummary> verify(DeviceSequence& sequence, std::span<const int32_t> tokens,
                                 std::span<const RowChoice> choices, DeviceBuffer<float>& streams,
                                 DeviceJournal* journal) const;
  // Mark before at most `ahead` tokens (into `mark`, whose buffers are reused); rewind
  // to the first `keep` of them, replaying their compressor inputs.
  void mark(const DeviceSequence& sequence, int64_t ahead, DeviceMark& mark) const;
  void rewind(DeviceSequence& sequence, const DeviceMark& mark, const DeviceJournal& journal, int64_t keep) const;
  void mark_draft(const DeviceSequence& sequence, int64_t ahead, DeviceMark& mark) const;
  void rewind_draft(DeviceSequence& sequence, const DeviceMark& mark) const;

  // Time per stage of the forward pass, summed over the calls since profiling was
  // turned on (CUDA events around each stage; off by default: they cost ~1 us each).
  void set_profiling(bool on);
  const std::map<std::string, double>& profile() const { return profile_; }

  // Decode steps replay CUDA graphs (on from the start; profiling and several ranks run
  // without them); off, every step launches kernel by kernel, with the same bits.
  void set_decode_graphs(bool on);
  DecodeGraphCounts decode_graph_counts() const;

  struct Layer;
  struct Kernels;
  struct Workspace;
  struct DecodeGraphs;
  struct SideStream;
  struct Begun;

 private:
  explicit GpuModel(const Model& host);  // in the .cpp, where the member types are complete
  // Runs the batch through the layers, then the head for the last head_rows[i] rows of
  // chunk i (0: none), leaving their logits in the workspace in chunk order; returns
  // how many rows that is. The stream is not synchronized.
  int64_t run(std::span<const DeviceChunk> batch, std::span<const int64_t> head_rows,
              DeviceJournal* journal = nullptr) const;
  void mark_layers(const DeviceSequence& sequence, size_t first, size_t count, int64_t length, int64_t ahead,
                   DeviceMark& mark) const;
  void restore_layers(DeviceSequence& sequence, size_t first, const DeviceMark& mark, int64_t keep) const;
  // Copies `rows` rows of logits back and ends the call; the host pointer lives until
  // the next call.
  const float* copy_back_logits(int64_t rows) const;
  // The first choices.size() rows of logits in the workspace, summarized for them by
  // `top`'s sampling kernel (on the host from copied-back rows when the plan chose the
  // host sampler, or when a summary does not suffice); ends the call.
  std::vector<RowSummary> summarize_logits(const Kernels& top, std::span<const RowChoice> choices) const;
  // Synchronizes the stream (the next call reuses the staging memory) and collects the
  // profile.
  void end_call() const;
  // Error(usage) naming `what` while a begun call is not finished.
  void require_idle(const char* what) const;
  // The begun call's summaries, once its event has passed (the rows a summary does not
  // suffice for summarized again here from the logits).
  void collect(Begun& call) const;

  const Model& host_;
  Plan plan_;
  int device_ = 0;
  ExpertShare share_;
  cudaStream_t stream_ = nullptr;
  std::vector<DeviceWeight> owned_;  // every uploaded weight, released at the end
  uint64_t weight_bytes_ = 0;
  std::unique_ptr<Kernels> top_kernels_, draft_top_kernels_;
  std::vector<Kernels> layer_kernels_;  // the trunk's layers, then the MTP block's (draft role)
  std::vector<Layer> layers_;           // likewise
  struct Mtp;
  std::unique_ptr<Mtp> mtp_;
  bool has_draft_ = false;
  DeviceRope rope_main_{}, rope_compress_{};
  DeviceWeight embed_{}, head_{};
  DeviceBuffer<float> norm_, head_fn_, head_base_, head_scale_;
  std::unique_ptr<Workspace> work_;
  std::unique_ptr<DecodeGraphs> graphs_;  // and the workspace of the steps they replay
  std::unique_ptr<SideStream> side_;      // the MoE's shared expert; an attention core's flush and beside-copies
  mutable Workspace* call_ = nullptr;     // the current call's workspace: work_'s or the graphs'
  std::shared_ptr<DeviceBlockPool> pool_;
  mutable std::map<std::string, double> profile_;
  DeviceBuffer<int32_t> tid2eid_;  // every hash layer's table, [hash layers, vocab, k], for picked tokens
  int hash_layers_ = 0;
  mutable std::vector<Begun> begun_;  // begun and not finished, oldest first
};

}  // namespace keel::cuda
