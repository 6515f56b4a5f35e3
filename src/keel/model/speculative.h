// Speculative decoding with the MTP layer (dsv4-forward.md §8): the MTP layer drafts up
// to k tokens, one trunk forward verifies them all, and the tokens the trunk would have
// chosen anyway are kept. A draft is accepted only when the sampler, on the trunk's
// logits, chooses it (same parameters, same draw of its stream), so the output is
// exactly that of decoding without speculation, greedy or sampled; only the number of
// trunk forwards changes. Drafts are chosen with the same parameters and the same draw
// as the trunk's choice at their position, which couples their noise and raises the
// acceptance when sampling.
//
// Rejected tokens are undone without copying state: the trunk is marked before the
// verification and rewound to the tokens kept (Model::rewind); the MTP layer's
// speculative positions are rewound the same way and run again from the trunk's streams.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/model.h"
#include "ops/sampling.h"

namespace keel {

// At most 3 drafts: the verification's 4 tokens keep the CPU linears on their per-token
// path (ops/linear.cpp), where a token's logits are those of a decode step, bit for bit.
inline constexpr int kMaxDraftTokens = 3;

// What speculative decoding needs from a model with an MTP layer and one sequence on
// it; the CPU's (below) and a GPU's implement it. A row the decoder chooses from is
// summarized where its logits were computed, for the choice the decoder will make
// (RowChoice: the sampler's parameters and draw), by the plan's sampling kernel (on a
// GPU only the summaries come back). The trunk's streams stay with the implementation:
// they wait for the MTP layer, which runs position p from the trunk's streams at p and
// the token after it.
class SpeculativeTarget {
 public:
  virtual ~SpeculativeTarget() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int64_t length() const = 0;  // trunk tokens run
  // The trunk runs the prompt (a fresh sequence): the last row, summarized for `choice`.
  virtual RowSummary prefill(std::span<const int32_t> prompt, const RowChoice& choice) = 0;
  // The MTP layer runs every waiting position, row i with next_tokens[i] (as many as
  // are waiting): the last row, summarized. Then further drafts may follow.
  virtual RowSummary draft(std::span<const int32_t> next_tokens, const RowChoice& choice) = 0;
  // One more MTP position, from its own last output streams and `token`.
  virtual RowSummary draft_more(int32_t token, const RowChoice& choice) = 0;
  // Undoes the draft_more positions since the last draft() (its state and last output).
  virtual void undo_drafts() = 0;
  // The trunk runs `tokens` (1 .. kMaxDraftTokens + 1): row i summarized for choices[i]
  // (one per token).
  virtual std::vector<RowSummary> verify(std::span<const int32_t> tokens, std::span<const RowChoice> choices) = 0;
  // Keeps the first `keep` tokens of the last verify (the trunk is rewound to them); their
  // streams wait for the MTP layer.
  virtual void keep(int64_t keep) = 0;
};

// The CPU's: a Model and a sequence of its own.
class CpuSpeculativeTarget final : public SpeculativeTarget {
 public:
  explicit CpuSpeculativeTarget(const Model& model);
  const ModelConfig& config() const override { return model_.config(); }
  int64_t length() const override { return sequence_.length; }
  RowSummary prefill(std::span<const int32_t> prompt, const RowChoice& choice) override;
  RowSummary draft(std::span<const int32_t> next_tokens, const RowChoice& choice) override;
  RowSummary draft_more(int32_t token, const RowChoice& choice) override;
  void undo_drafts() override;
  std::vector<RowSummary> verify(std::span<const int32_t> tokens, std::span<const RowChoice> choices) override;
  void keep(int64_t keep) override;

 private:
  const Model& model_;
  Sequence sequence_;
  std::vector<float> waiting_;       // trunk streams of the positions the MTP layer has not run
  std::vector<float> verified_;      // the last verify's streams
  std::vector<float> draft_streams_; // the MTP layer's last output row
  std::vector<float> first_streams_; // ... as draft() left it
  SequenceMark trunk_mark_, draft_mark_;
  ForwardJournal journal_;
  int64_t verified_tokens_ = 0;
};

class SpeculativeDecoder {
 public:
  // draft_tokens: 1 .. kMaxDraftTokens. Error(usage) for a model without an MTP layer.
  SpeculativeDecoder(SpeculativeTarget& target, int draft_tokens);

  // Runs the prompt; returns the first token `sampler` chooses.
  int32_t start(std::span<const int32_t> prompt, Sampler& sampler);
  // Drafts, verifies and returns the next tokens (1 .. draft_tokens + 1), each chosen by
  // `sampler` from the trunk's logits. The last one has not run through the trunk yet.
  std::vector<int32_t> step(Sampler& sampler);

  // start, then steps until `count` tokens (the first `count` of what the steps give).
  std::vector<int32_t> generate(std::span<const int32_t> prompt, int count, Sampler& sampler);

  struct Stats {
    int64_t steps = 0;     // trunk forwards after the prompt
    int64_t drafted = 0;   // draft tokens verified
    int64_t accepted = 0;  // of them, kept
    int64_t tokens = 0;    // tokens returned by step()
  };
  const Stats& stats() const { return stats_; }

 private:
  SpeculativeTarget& target_;
  int draft_tokens_;
  std::vector<int32_t> waiting_tokens_;  // the token after each position waiting for the MTP layer
  Stats stats_;
};

}  // namespace keel
