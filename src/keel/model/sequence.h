// The incremental state of one sequence (dsv4-forward.md §7.1). It grows with the
// tokens actually processed: a sliding-window ring per layer (at most sliding_window
// K=V vectors), one compressed entry per m tokens, and less than one window of pending
// projections. Nothing is sized by the maximum context.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/block_pool.h"

namespace keel {

// Every row array below lives in the blocks of the sequence's state pool (block_pool.h):
// copies of a sequence share blocks until one of them writes.
struct CompressorState {
  PagedRows entries;  // [count, dim]: pooled, normalized, rotated to the window start
  int64_t count = 0;
  // Projections of the tokens of the open window, [pending, width]; gate logits are
  // kept without the position bias (added when the window closes).
  PagedRows pending_kv, pending_gate;
  int pending = 0;
  // CSA: the closed window's first-half series, which the next entry pools too; gate
  // logits with their position bias. [ratio, dim] each, empty before the first window.
  PagedRows carry_kv, carry_gate;

  CompressorState() = default;
  CompressorState(const std::shared_ptr<HostBlockPool>& pool, int64_t dim, bool overlapping);
};

struct LayerState {
  PagedRows window;  // ring of K=V vectors: position p in slot p % sliding_window
  CompressorState compressor;
  CompressorState indexer;  // CSA: index keys
};

struct Sequence {
  int64_t length = 0;  // tokens processed; the next token's position
  std::vector<LayerState> layers;
  // The MTP layer's own state (dsv4-forward.md §8): its block's sliding-window ring, and
  // how many positions it has run (it runs position p from the trunk's streams at p and
  // token p + 1, so it trails the trunk by at least one).
  std::vector<LayerState> draft;
  int64_t draft_length = 0;

  // Bytes of the blocks held (blocks shared with a copy counted in each).
  uint64_t state_bytes() const;
};

// What rewinding a sequence to an earlier length needs, taken before tokens run on it
// (speculative decoding's verification, which may keep only some of them): the ring
// rows those tokens overwrite, and each compressor's open window, carry and count. The
// compressors' entries are truncated, and the kept tokens' projections replayed
// (Model::rewind), so no state ever has to be copied whole: the open windows and carries
// are kept by sharing their blocks.
struct SequenceMark {
  struct Compressor {
    int64_t count = 0;
    int pending = 0;
    PagedRows pending_kv, pending_gate, carry_kv, carry_gate;  // shared blocks, not copies
  };
  struct Layer {
    std::vector<float> ring_rows;  // the slots of positions [length, length + ahead), in order
    bool ring_empty = false;
    Compressor compressor, indexer;
  };
  int64_t length = 0, ahead = 0;
  std::vector<Layer> layers;
};

// Marks `layers` at `length` before at most `ahead` more tokens run
// (ahead <= sliding_window).
SequenceMark mark_layers(const std::vector<LayerState>& layers, int64_t length, int64_t ahead, int64_t sliding_window,
                         int64_t head_dim);
// Puts the ring rows and the compressors back as they were at the mark; the ring rows
// of the first `keep` positions after it stay as they are now.
void restore_layers(std::vector<LayerState>& layers, const SequenceMark& mark, int64_t keep, int64_t sliding_window,
                    int64_t head_dim);

}  // namespace keel
