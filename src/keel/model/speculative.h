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

class SpeculativeDecoder {
 public:
  // draft_tokens: 1 .. kMaxDraftTokens. Error(usage) for a model without an MTP layer.
  SpeculativeDecoder(const Model& model, int draft_tokens);

  // Runs the prompt on a fresh sequence; returns the first token `sampler` chooses.
  int32_t start(Sequence& sequence, std::span<const int32_t> prompt, Sampler& sampler);
  // Drafts, verifies and returns the next tokens (1 .. draft_tokens + 1), each chosen by
  // `sampler` from the trunk's logits. The last one has not run through the trunk yet.
  std::vector<int32_t> step(Sequence& sequence, Sampler& sampler);

  struct Stats {
    int64_t steps = 0;     // trunk forwards after the prompt
    int64_t drafted = 0;   // draft tokens verified
    int64_t accepted = 0;  // of them, kept
    int64_t tokens = 0;    // tokens returned by step()
  };
  const Stats& stats() const { return stats_; }

 private:
  const Model& model_;
  int draft_tokens_;
  // The MTP layer's inputs not run yet: for positions draft_length .. length − 1, the
  // trunk's streams and the token after each (the last is the next token).
  std::vector<float> streams_;
  std::vector<int32_t> tokens_;
  Stats stats_;
};

}  // namespace keel
