// A DeepSeek-V4 model on the CPU: the reference forward pass every other backend is
// measured against (dsv4-forward.md). Weights are used in their stored formats.
//
// One entry point serves full forwards, chunked prefill and decode: `forward` appends
// tokens to a Sequence's incremental state and returns their logits. A full forward is
// one call on a fresh sequence; any split of the same tokens gives the same logits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/kernels.h"
#include "model/layers.h"
#include "model/sequence.h"
#include "model/weights.h"
#include "ops/rope.h"

namespace keel {

enum class LogitRows { all, last };

// A forward call's compressor inputs, per layer: the projections (kv, gate) of the
// chunk's tokens, which Model::rewind replays for the tokens it keeps.
struct CompressorJournal {
  std::vector<float> kv, gate;
};
struct LayerJournal {
  CompressorJournal compressor, indexer;
};
using ForwardJournal = std::vector<LayerJournal>;

// What a forward call can hand back besides logits (speculative decoding's needs).
struct ForwardExtras {
  std::vector<float>* streams = nullptr;  // every token's streams before hc_head, [tokens, hc, D]
  ForwardJournal* journal = nullptr;
};

// Error(bad_input) for an empty call, an id outside the vocabulary (naming it and its
// index), or a sequence of `length` tokens that `tokens` would take past
// max_position_embeddings. Every backend checks its input with it.
void check_tokens(const ModelConfig& config, int64_t length, std::span<const int32_t> tokens);

// The mHC parameters of the config.
HyperParams hyper_params(const ModelConfig& config);

class Model {
 public:
  // Called while weights are read in: bytes done, bytes total.
  using Progress = std::function<void(uint64_t done, uint64_t total)>;

  // Opens DIRECTORY (config.json + safetensors), resolves the kernel plan for the CPU
  // (with the user's backend choices) before reading any weight, then binds and checks
  // every tensor. With `progress`, also reads every weight page once (so the first
  // tokens do not pay for page faults) and reports as it goes.
  static std::unique_ptr<Model> load(const std::string& directory, const Progress& progress = {},
                                     const BackendChoices& target = {}, const BackendChoices& draft = {});

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return *weights_; }
  const ModelTensors& tensors() const { return tensors_; }
  const Plan& plan() const { return plan_; }

  // A fresh sequence whose state takes blocks from `pool` (null: the model's own pool,
  // which has no capacity limit), a pool of state_block_floats() blocks.
  Sequence new_sequence(std::shared_ptr<HostBlockPool> pool = nullptr) const;
  // A state block holds 16 rows of head_dim floats (the widest rows are two of them).
  int64_t state_block_floats() const { return 16 * int64_t{config_.head_dim}; }
  // At most how many blocks running `tokens` more on `sequence` takes from its pool
  // (new rows, blocks copied because a snapshot still shares them, open windows that
  // close and reopen): what a step must have free before it runs.
  int64_t blocks_needed(const Sequence& sequence, int64_t tokens) const;

  // Runs `tokens` after what `sequence` holds and returns their logits, [tokens, vocab]
  // (or only the last row). Throws Error(bad_input) for ids outside the vocabulary, an
  // empty call, or a sequence that would pass max_position_embeddings; the sequence is
  // unchanged then.
  std::vector<float> forward(Sequence& sequence, std::span<const int32_t> tokens,
                             LogitRows rows = LogitRows::all, const ForwardExtras& extras = {}) const;

  // Several sequences' tokens in one call (each sequence at most once), for batched
  // serving: the matrix products run over all rows at once, so each weight is read once
  // per call, and every chunk's results are bit for bit those of forward() on it alone.
  // Returns the logits of the last head_rows[i] rows of chunk i (0: none), chunk by
  // chunk. Bad input as forward(), every chunk checked before any sequence changes.
  struct Chunk {
    Sequence* sequence = nullptr;
    std::span<const int32_t> tokens;
  };
  std::vector<std::vector<float>> forward(std::span<const Chunk> batch, std::span<const int64_t> head_rows) const;

  // --- The MTP layer (dsv4-forward.md §8), for speculative decoding ---
  bool has_draft() const { return !tensors_.mtp.empty(); }
  // Runs the MTP layer at positions draft_length .. + n - 1: row i takes the trunk's
  // streams at that position (`trunk_streams`, [n, hc, D], as forward's extras give
  // them, or the MTP's own output streams for a further draft) and the token after it
  // (`next_tokens`), and gives the logits for the token after that ([n, V], or only the
  // last row). `out_streams` gets the MTP block's output streams of those rows.
  std::vector<float> draft(Sequence& sequence, std::span<const float> trunk_streams,
                           std::span<const int32_t> next_tokens, LogitRows rows = LogitRows::last,
                           std::vector<float>* out_streams = nullptr) const;
  // Rewinding the trunk: mark before a forward of at most `ahead` tokens (with a
  // journal), then keep only the first `keep` of them.
  SequenceMark mark(const Sequence& sequence, int64_t ahead) const;
  void rewind(Sequence& sequence, const SequenceMark& mark, const ForwardJournal& journal, int64_t keep) const;
  // The same for the MTP layer's state (a sliding-window block: nothing to replay).
  SequenceMark mark_draft(const Sequence& sequence, int64_t ahead) const;
  void rewind_draft(Sequence& sequence, const SequenceMark& mark) const;

  // Weight bytes one decode step reads: every dense linear, k routed experts per MoE
  // layer, one embedding row and the lm_head (for bandwidth figures).
  uint64_t decode_bytes_per_token() const;
  // Multiply-adds of the same weights for one token (2 FLOPs each; prefill throughput).
  uint64_t linear_macs_per_token() const;
  // Sequence state that grows with the context, per token: compressed entries (head_dim
  // floats per m tokens, CSA and HCA layers) and indexer keys (index_head_dim per m_csa
  // tokens), f32 as keel stores them.
  double state_bytes_per_token() const;
  // What a sequence holds at most whatever its length: the sliding-window rings (trunk
  // and MTP) and each compressor's open window and carried series.
  uint64_t state_bytes_per_sequence() const;

 private:
  Model() = default;
  std::vector<std::vector<float>> run(std::span<const Chunk> batch, std::span<const int64_t> head_rows,
                                      const ForwardExtras& extras) const;

  ModelConfig config_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<ModelWeights> weights_;
  ModelTensors tensors_;
  Plan plan_;
  LayerKernels top_kernels_;                 // embedding, hc_head, final norm, lm_head
  std::vector<LayerKernels> layer_kernels_;  // trunk layers
  LayerKernels draft_kernels_;               // the MTP layer (model role: draft)
  LayerKernels draft_top_kernels_;           // the draft's embedding and lm_head
  Rope rope_main_;      // sliding layers
  Rope rope_compress_;  // CSA / HCA layers
  std::shared_ptr<HostBlockPool> pool_;  // new_sequence's default
};

}  // namespace keel
