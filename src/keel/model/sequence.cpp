#include "model/sequence.h"

#include <algorithm>

#include "base/error.h"

namespace keel {
namespace {

SequenceMark::Compressor mark_compressor(const CompressorState& c) {
  return {c.count, c.pending, c.pending_kv, c.pending_gate, c.carry_kv, c.carry_gate};
}

void restore_compressor(CompressorState& c, const SequenceMark::Compressor& m) {
  c.count = m.count;
  c.entries.resize(m.count);
  c.pending = m.pending;
  c.pending_kv = m.pending_kv;
  c.pending_gate = m.pending_gate;
  c.carry_kv = m.carry_kv;
  c.carry_gate = m.carry_gate;
}

// Calls fn on every row array a sequence holds.
template <typename Fn>
void for_each_rows(const Sequence& s, Fn&& fn) {
  for (const auto* group : {&s.layers, &s.draft}) {
    for (const LayerState& l : *group) {
      fn(l.window);
      for (const CompressorState* c : {&l.compressor, &l.indexer}) {
        for (const PagedRows* r : {&c->entries, &c->pending_kv, &c->pending_gate, &c->carry_kv, &c->carry_gate}) fn(*r);
      }
    }
  }
}

}  // namespace

CompressorState::CompressorState(const std::shared_ptr<HostBlockPool>& pool, int64_t dim, bool overlapping)
    : entries(pool, dim),
      pending_kv(pool, overlapping ? 2 * dim : dim),
      pending_gate(pool, overlapping ? 2 * dim : dim),
      carry_kv(pool, dim),
      carry_gate(pool, dim) {}

uint64_t Sequence::state_bytes() const {
  uint64_t bytes = 0;
  for_each_rows(*this, [&](const PagedRows& r) { bytes += r.bytes(); });
  return bytes;
}

SequenceMark mark_layers(const std::vector<LayerState>& layers, int64_t length, int64_t ahead, int64_t sw,
                         int64_t hd) {
  if (ahead < 0 || ahead > sw) fail(ErrorCode::usage, {}, "a sequence mark covers 0 .. sliding_window tokens ahead");
  SequenceMark m{length, ahead, {}};
  for (const LayerState& l : layers) {
    SequenceMark::Layer& out = m.layers.emplace_back();
    out.ring_empty = l.window.empty();
    if (!out.ring_empty) {
      for (int64_t p = length; p < length + ahead; ++p) {
        const float* row = l.window.row(p % sw);
        out.ring_rows.insert(out.ring_rows.end(), row, row + hd);
      }
    }
    out.compressor = mark_compressor(l.compressor);
    out.indexer = mark_compressor(l.indexer);
  }
  return m;
}

void restore_layers(std::vector<LayerState>& layers, const SequenceMark& m, int64_t keep, int64_t sw, int64_t hd) {
  if (keep < 0 || keep > m.ahead || layers.size() != m.layers.size()) {
    fail(ErrorCode::usage, {}, "a sequence is rewound with a mark of another shape or past its tokens");
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerState& l = layers[i];
    const SequenceMark::Layer& ml = m.layers[i];
    if (ml.ring_empty) {
      if (keep == 0) l.window.clear();
    } else {
      for (int64_t p = m.length + keep; p < m.length + m.ahead; ++p) {
        std::copy_n(&ml.ring_rows[(p - m.length) * hd], hd, l.window.write_row(p % sw));
      }
    }
    restore_compressor(l.compressor, ml.compressor);
    restore_compressor(l.indexer, ml.indexer);
  }
}

}  // namespace keel
