// The incremental state of one sequence (dsv4-forward.md §7.1). It grows with the
// tokens actually processed: a sliding-window ring per layer (at most sliding_window
// K=V vectors), one compressed entry per m tokens, and less than one window of pending
// projections. Nothing is sized by the maximum context.
#pragma once

#include <cstdint>
#include <vector>

namespace keel {

struct CompressorState {
  std::vector<float> entries;  // [count, dim]: pooled, normalized, rotated to the window start
  int64_t count = 0;
  // Projections of the tokens of the open window, [pending, width]; gate logits are
  // kept without the position bias (added when the window closes).
  std::vector<float> pending_kv, pending_gate;
  int pending = 0;
  // CSA: the closed window's first-half series, which the next entry pools too; gate
  // logits with their position bias. [ratio, dim] each, empty before the first window.
  std::vector<float> carry_kv, carry_gate;
};

struct LayerState {
  std::vector<float> window;  // ring of K=V vectors: position p in slot p % sliding_window
  CompressorState compressor;
  CompressorState indexer;    // CSA: index keys
};

struct Sequence {
  int64_t length = 0;  // tokens processed; the next token's position
  std::vector<LayerState> layers;

  // Bytes held, for reports and tests of growth.
  uint64_t state_bytes() const;
};

}  // namespace keel
