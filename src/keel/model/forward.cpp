// Model::forward: dsv4-forward.md §3–§7 over chunks of new tokens of one or several
// sequences. Matrix products run over all rows of the call at once (each sequence's
// chunk computed as it would be alone: ConstRows::chunks); attention runs per token
// against its sequence's state plus its chunk's own keys, so a chunk of any size gives
// the logits of a full forward, in a batch or alone.
#include <algorithm>
#include <cmath>
#include <string>

#include "base/error.h"
#include "model/model.h"
#include "ops/attention.h"
#include "ops/compressor.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/norm.h"

namespace keel {
namespace {

using Buffer = std::vector<float>;

// One sequence's chunk in a forward call: `count` tokens from position `start`, rows
// [row, row + count) of the call.
struct Part {
  int64_t start = 0, row = 0, count = 0;
};

// What every step of one forward call needs.
struct Step {
  const ModelConfig& c;
  const LayerKernels& k;  // what the plan chose for this layer
  const Rope& rope;       // of the layer being run
  std::span<const Part> parts;
  std::span<LayerState* const> states;  // per part: this layer's state of its sequence
  std::span<const int32_t> tokens;      // every row's token
  std::span<const int64_t> chunks;      // per part: its row count (linear's chunks)
  std::span<const int32_t> part_of;     // per row
  int64_t count = 0;                    // rows
  float eps() const { return static_cast<float>(c.rms_norm_eps); }
  int64_t position(int64_t row) const {
    const Part& p = parts[part_of[row]];
    return p.start + row - p.row;
  }
  // All rows, chunked by part.
  ConstRows rows(const float* data, int64_t width) const { return {data, count, width, chunks}; }
  ConstRows rows(const Buffer& data, int64_t width) const { return rows(data.data(), width); }
};

// The parts' layout, kept alive for the Steps that point into it.
struct Batch {
  std::vector<Part> parts;
  std::vector<int64_t> chunks;
  std::vector<int32_t> part_of;
  std::vector<int32_t> tokens;
  int64_t count = 0;

  void add(int64_t start, std::span<const int32_t> chunk) {
    const auto n = static_cast<int64_t>(chunk.size());
    parts.push_back({start, count, n});
    chunks.push_back(n);
    part_of.insert(part_of.end(), static_cast<size_t>(n), static_cast<int32_t>(parts.size() - 1));
    tokens.insert(tokens.end(), chunk.begin(), chunk.end());
    count += n;
  }
  Step step(const ModelConfig& c, const LayerKernels& k, const Rope& rope, std::span<LayerState* const> states) const {
    return {c, k, rope, parts, states, tokens, chunks, part_of, count};
  }
};

Buffer project(LayerKernels::Linear* kernel, const Weight& w, ConstRows x) {
  Buffer y(static_cast<size_t>(x.count * out_features(w)));
  kernel(w, x, rows_of(std::span<float>(y), out_features(w)), {});
  return y;
}
Buffer project(const Step& s, const Weight& w, ConstRows x) { return project(s.k.linear_for(w), w, x); }

void norm_rows(const Step& s, Buffer& x, int64_t width, std::span<const float> weight) {
  for (size_t r = 0; r < x.size(); r += width) {
    std::span<float> row(x.data() + r, width);
    s.k.norm(row, weight, s.eps(), row);
  }
}

// --- Compressors (§5.6, §5.7, §7.2) ----------------------------------------------------

// Pools the full pending window into entry number `state.count`.
void close_window(const Step& s, const CompressorWeights& w, CompressorState& st) {
  const int m = w.ratio, dim = w.dim, width = w.width();
  Buffer kv, gate;  // the window's slots, [slots, dim]
  const auto add_slot = [&](const float* v, const float* g, const float* bias) {
    kv.insert(kv.end(), v, v + dim);
    if (!bias) {
      gate.insert(gate.end(), g, g + dim);
    } else {
      for (int c = 0; c < dim; ++c) gate.push_back(g[c] + bias[c]);
    }
  };
  const int half = w.overlapping ? dim : 0;  // CSA: this entry pools the second series
  if (w.overlapping) {  // the carried series has its bias already
    for (int64_t j = 0; j < st.carry_kv.size(); ++j) add_slot(st.carry_kv.row(j), st.carry_gate.row(j), nullptr);
  }
  for (int j = 0; j < m; ++j) {
    add_slot(st.pending_kv.row(j) + half, st.pending_gate.row(j) + half, &w.ape[j * width + half]);
  }
  if (w.overlapping) {  // the first series joins the next entry, bias included
    st.carry_kv.resize(m);
    st.carry_gate.resize(m);
    for (int j = 0; j < m; ++j) {
      std::copy_n(st.pending_kv.row(j), dim, st.carry_kv.write_row(j));
      const float* g = st.pending_gate.row(j);
      float* out = st.carry_gate.write_row(j);
      for (int c = 0; c < dim; ++c) out[c] = g[c] + w.ape[j * width + c];
    }
  }
  Buffer entry(dim);
  s.k.pool(kv, gate, static_cast<int>(kv.size() / dim), dim, entry);
  s.k.norm(entry, w.norm, s.eps(), entry);
  s.rope.apply(entry, st.count * m);  // an entry sits at its window's start
  st.entries.push_back(entry.data());
  ++st.count;
  st.pending = 0;
  st.pending_kv.clear();
  st.pending_gate.clear();
}

// `n` tokens' projections join the open window, closing each window they fill.
void append(const Step& s, const CompressorWeights& w, CompressorState& st, const float* kv, const float* gate,
            int64_t n) {
  const int width = w.width();
  for (int64_t t = 0; t < n; ++t) {
    st.pending_kv.push_back(&kv[t * width]);
    st.pending_gate.push_back(&gate[t * width]);
    if (++st.pending == w.ratio) close_window(s, w, st);
  }
}

// Every row's projections, then each part's into the compressor `which` of its state.
// With `journal` (one part), the projections are kept there too (for Model::rewind's
// replay).
void compress(const Step& s, const CompressorWeights& w, CompressorState LayerState::*which, ConstRows x,
              CompressorJournal* journal) {
  Buffer kv = project(s, *w.wkv, x), gate = project(s, *w.wgate, x);
  const int width = w.width();
  for (size_t i = 0; i < s.parts.size(); ++i) {
    const Part& p = s.parts[i];
    append(s, w, s.states[i]->*which, &kv[p.row * width], &gate[p.row * width], p.count);
  }
  if (journal) *journal = {std::move(kv), std::move(gate)};
}

// --- Attention (§5) ----------------------------------------------------------------------

struct Queries {
  Buffer qr;  // [S, q_lora_rank], normalized: feeds q and the indexer
  Buffer q;   // [S, H·hd], per-head normalized and rotated
  Buffer kv;  // [S, hd], normalized and rotated
};

Queries queries(const Step& s, const AttentionWeights& a, ConstRows x) {
  const ModelConfig& c = s.c;
  Queries r{project(s, *a.wq_a, x)};
  norm_rows(s, r.qr, c.q_lora_rank, a.q_norm);
  r.q = project(s, *a.wq_b, s.rows(r.qr, c.q_lora_rank));
  r.kv = project(s, *a.wkv, x);
  norm_rows(s, r.kv, c.head_dim, a.kv_norm);
  const int64_t heads = c.num_attention_heads, hd = c.head_dim;
  for (int64_t t = 0; t < s.count; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::span<float> head(&r.q[(t * heads + h) * hd], hd);
      rms_norm_unweighted(head, s.eps());
      s.rope.apply(head, s.position(t));
    }
    s.rope.apply(std::span<float>(&r.kv[t * hd], hd), s.position(t));
  }
  return r;
}

// The lightning indexer's per-token queries and head weights (§5.8).
struct IndexQueries {
  Buffer q;        // [S, nI·dI], rotated
  Buffer weights;  // [S, nI], scaled by nI^-0.5
};

IndexQueries index_queries(const Step& s, const IndexerWeights& w, const Buffer& qr, ConstRows x) {
  const ModelConfig& c = s.c;
  IndexQueries r{project(s, *w.wq_b, s.rows(qr, c.q_lora_rank)), project(s, *w.weights_proj, x)};
  const int64_t stride = int64_t{c.index_n_heads} * c.index_head_dim;
  for (int64_t t = 0; t < s.count; ++t) {
    s.rope.apply_heads(std::span<float>(&r.q[t * stride], stride), c.index_head_dim, s.position(t));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.index_n_heads));
  for (float& v : r.weights) v *= scale;
  return r;
}

// Keys of row t's token: its sliding window (its chunk's own keys, then its sequence's
// ring), then the compressed entries it sees.
std::vector<const float*> key_set(const Step& s, const AttentionWeights& a, const Queries& qs,
                                  const IndexQueries* iq, int64_t t) {
  const ModelConfig& c = s.c;
  const int64_t hd = c.head_dim, sw = c.sliding_window;
  const Part& part = s.parts[s.part_of[t]];
  const LayerState& st = *s.states[s.part_of[t]];
  const int64_t position = s.position(t);
  std::vector<const float*> keys;
  for (int64_t j = std::max<int64_t>(0, position - sw + 1); j <= position; ++j) {
    keys.push_back(j >= part.start ? &qs.kv[(part.row + j - part.start) * hd] : st.window.row(j % sw));
  }
  if (!a.compressor) return keys;
  const int64_t visible = (position + 1) / a.compressor->ratio;
  const PagedRows& entries = st.compressor.entries;
  if (!a.indexer) {
    for (int64_t w = 0; w < visible; ++w) keys.push_back(entries.row(w));
    return keys;
  }
  const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
  std::vector<const float*> index_keys;
  st.indexer.entries.row_pointers(visible, index_keys);
  const auto picked = s.k.index(std::span(&iq->q[t * nI * dI], nI * dI), std::span(&iq->weights[t * nI], nI),
                                c.index_n_heads, c.index_head_dim, index_keys, c.index_topk);
  for (int64_t w : picked) keys.push_back(entries.row(w));
  return keys;
}

// Each part's newest keys into its sequence's ring.
void remember_window(const Step& s, const Buffer& kv) {
  const int64_t hd = s.c.head_dim, sw = s.c.sliding_window;
  for (size_t i = 0; i < s.parts.size(); ++i) {
    const Part& part = s.parts[i];
    const int64_t end = part.start + part.count;
    for (int64_t p = std::max(part.start, end - sw); p < end; ++p) {
      std::copy_n(&kv[(part.row + p - part.start) * hd], hd, s.states[i]->window.write_row(p % sw));
    }
  }
}

Buffer attention(const Step& s, const AttentionWeights& a, ConstRows x, LayerJournal* journal) {
  const ModelConfig& c = s.c;
  const int64_t H = c.num_attention_heads, hd = c.head_dim;
  const Queries qs = queries(s, a, x);
  if (a.compressor) compress(s, *a.compressor, &LayerState::compressor, x, journal ? &journal->compressor : nullptr);
  IndexQueries iq;
  if (a.indexer) {
    compress(s, a.indexer->compressor, &LayerState::indexer, x, journal ? &journal->indexer : nullptr);
    iq = index_queries(s, *a.indexer, qs.qr, x);
  }
  for (LayerState* st : s.states) {
    if (st->window.empty()) st->window.resize(c.sliding_window);
  }

  Buffer o(static_cast<size_t>(s.count * H * hd));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for schedule(dynamic, 1) if (s.count > 1)
  for (int64_t t = 0; t < s.count; ++t) {
    const auto keys = key_set(s, a, qs, a.indexer ? &iq : nullptr, t);
    std::span<float> out(&o[t * H * hd], H * hd);
    // As the part's own call would: one token is a decode step.
    const auto attend = s.parts[s.part_of[t]].count == 1 ? s.k.attend_decode : s.k.attend_prefill;
    attend(std::span(&qs.q[t * H * hd], H * hd), H, hd, keys, a.sinks, scale, out);
    s.rope.apply_heads(out, hd, s.position(t), /*inverse=*/true);  // V carried K's rotation
  }
  remember_window(s, qs.kv);

  // Grouped output projection: group g's heads through rows [g·r, (g+1)·r) of wo_a.
  const int64_t G = c.o_groups, r = c.o_lora_rank, group_in = H * hd / G;
  Buffer u(static_cast<size_t>(s.count * G * r));
  for (int64_t g = 0; g < G; ++g) {
    s.k.linear_for(*a.wo_a)(*a.wo_a, s.rows(o.data() + g * group_in, H * hd), Rows{u.data() + g * r, s.count, G * r},
                            RowRange{g * r, r});
  }
  return project(s, *a.wo_b, s.rows(u, G * r));
}

// --- MoE (§6) ----------------------------------------------------------------------------

// acc.row(t) += weight_t · down(clamped_swiglu(gate(x_t), up(x_t))) for the rows `rows`;
// routed experts through the plan's MoE kernel, the shared expert through its dense one.
// `rows` ascend, so each part's rows are consecutive: chunked by part, as the part's own
// call would run them.
void run_expert(const Step& s, const ExpertWeights& e, bool routed, ConstRows x, const std::vector<int64_t>& rows,
                const std::vector<float>& weights, Buffer& acc) {
  const int64_t D = s.c.hidden_size, I = s.c.moe_intermediate_size, n = static_cast<int64_t>(rows.size());
  Buffer xs(static_cast<size_t>(n * D));
  std::vector<int64_t> chunks;
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(x.row(rows[i]), D, &xs[i * D]);
    if (i == 0 || s.part_of[rows[i]] != s.part_of[rows[i - 1]]) chunks.push_back(0);
    ++chunks.back();
  }
  const auto kernel = [&](const Weight& w) { return routed ? s.k.expert_for(w) : s.k.linear_for(w); };
  Buffer g = project(kernel(*e.w1), *e.w1, ConstRows{xs.data(), n, D, chunks});
  const Buffer u = project(kernel(*e.w3), *e.w3, ConstRows{xs.data(), n, D, chunks});
  clamped_swiglu(g, u, static_cast<float>(s.c.swiglu_limit));
  const Buffer y = project(kernel(*e.w2), *e.w2, ConstRows{g.data(), n, I, chunks});
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < D; ++d) acc[rows[i] * D + d] += weights[i] * y[i * D + d];
  }
}

Buffer moe(const Step& s, const MoeWeights& m, ConstRows x) {
  const ModelConfig& c = s.c;
  const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
  Buffer scores = project(s, *m.gate, x);
  std::vector<std::vector<int64_t>> rows(E);
  std::vector<std::vector<float>> weights(E);
  for (int64_t t = 0; t < s.count; ++t) {
    std::span<float> row(&scores[t * E], E);
    score_router(row, c.scoring_func);
    std::span<const int32_t> hashed;
    if (m.kind == MlpKind::hash_moe) hashed = std::span(&m.tid2eid[s.tokens[t] * k], k);
    const Routing r = route(row, m.bias, hashed, static_cast<int>(k), static_cast<float>(c.routed_scaling_factor));
    for (int64_t i = 0; i < k; ++i) {
      rows[r.experts[i]].push_back(t);
      weights[r.experts[i]].push_back(r.weights[i]);
    }
  }
  Buffer out(static_cast<size_t>(s.count * c.hidden_size), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    if (!rows[e].empty()) run_expert(s, m.experts[e], true, x, rows[e], weights[e], out);
  }
  std::vector<int64_t> all(s.count);
  for (int64_t t = 0; t < s.count; ++t) all[t] = t;
  run_expert(s, m.shared, false, x, all, std::vector<float>(s.count, 1.0f), out);
  return out;
}

// --- One decoder layer (§3.1) ------------------------------------------------------------

// Runs `sublayer` on the streams collapsed by `site`, then mixes its output back in.
template <typename Sublayer>
void hyper_block(const Step& s, const HyperParams& hp, const HyperSite& site, std::span<const float> norm,
                 Buffer& streams, Sublayer&& sublayer) {
  const int64_t D = s.c.hidden_size, width = hp.hc * D;
  std::vector<HyperMix> mixes(s.count);
  Buffer x(static_cast<size_t>(s.count * D));
#pragma omp parallel for if (s.count > 1)
  for (int64_t t = 0; t < s.count; ++t) {
    const std::span<const float> token(&streams[t * width], width);
    mixes[t] = s.k.mix(hp, site, token);
    std::span<float> xt(&x[t * D], D);
    hyper_collapse(hp, mixes[t].pre, token, xt);
    s.k.norm(xt, norm, s.eps(), xt);
  }
  const Buffer y = sublayer(s.rows(x, D));
#pragma omp parallel for if (s.count > 1)
  for (int64_t t = 0; t < s.count; ++t) {
    hyper_expand(hp, mixes[t], std::span(&y[t * D], D), std::span(&streams[t * width], width));
  }
}

}  // namespace

HyperParams hyper_params(const ModelConfig& c) {
  return {c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, static_cast<float>(c.hc_eps),
          static_cast<float>(c.rms_norm_eps)};
}

void check_tokens(const ModelConfig& c, int64_t length, std::span<const int32_t> tokens) {
  if (tokens.empty()) fail(ErrorCode::bad_input, {}, "no tokens to run (an empty prompt?)");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      fail(ErrorCode::bad_input, {},
           "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) + " is outside the vocabulary [0, " +
               std::to_string(c.vocab_size) + ")");
    }
  }
  const int64_t end = length + static_cast<int64_t>(tokens.size());
  if (end > c.max_position_embeddings) {
    fail(ErrorCode::bad_input, {},
         std::to_string(end) + " tokens exceed the model's context of " + std::to_string(c.max_position_embeddings) +
             " (max_position_embeddings)");
  }
}

namespace {

// The logits of `n` rows of streams ([n, hc, D]) through a head (hc_head, norm, lm_head),
// the rows in `chunks` (as ConstRows::chunks; empty: one).
Buffer head_logits(const ModelConfig& c, const HyperParams& hp, const HyperHead& hc_head, std::span<const float> norm,
                   const LayerKernels& k, const LayerKernels& head_kernels, const Weight& head, const float* streams,
                   int64_t n, std::span<const int64_t> chunks = {}) {
  const int64_t D = c.hidden_size, width = hp.hc * D;
  Buffer h(static_cast<size_t>(n * D));
  for (int64_t t = 0; t < n; ++t) {
    std::span<float> ht(&h[t * D], D);
    hyper_head(hp, hc_head, std::span(streams + t * width, width), ht);
    k.norm(ht, norm, static_cast<float>(c.rms_norm_eps), ht);
  }
  Buffer logits(static_cast<size_t>(n * c.vocab_size));
  head_kernels.linear_for(head)(head, ConstRows{h.data(), n, D, chunks}, rows_of(std::span<float>(logits), c.vocab_size),
                                {});
  return logits;
}

// One decoder layer over the call's streams.
void run_layer(const Step& s, const HyperParams& hp, const LayerWeights& L, Buffer& streams, LayerJournal* journal) {
  hyper_block(s, hp, L.hc_attn, L.attn_norm, streams, [&](ConstRows x) { return attention(s, L.attn, x, journal); });
  hyper_block(s, hp, L.hc_ffn, L.ffn_norm, streams, [&](ConstRows x) { return moe(s, L.ffn, x); });
}

}  // namespace

std::vector<float> Model::forward(Sequence& seq, std::span<const int32_t> tokens, LogitRows which,
                                  const ForwardExtras& extras) const {
  const Chunk chunk{&seq, tokens};
  const int64_t rows = which == LogitRows::last ? 1 : static_cast<int64_t>(tokens.size());
  return std::move(run(std::span(&chunk, 1), std::span(&rows, 1), extras).front());
}

std::vector<std::vector<float>> Model::forward(std::span<const Chunk> batch, std::span<const int64_t> head_rows) const {
  return run(batch, head_rows, {});
}

std::vector<std::vector<float>> Model::run(std::span<const Chunk> batch, std::span<const int64_t> head_rows,
                                           const ForwardExtras& extras) const {
  const ModelConfig& c = config_;
  if (head_rows.size() != batch.size()) fail(ErrorCode::usage, {}, "a batched forward needs head rows per chunk");
  if (batch.size() != 1 && (extras.streams || extras.journal)) {
    fail(ErrorCode::usage, {}, "streams and journals are for one sequence's forward");
  }
  for (size_t i = 0; i < batch.size(); ++i) {  // everything checked before any state changes
    check_tokens(c, batch[i].sequence->length, batch[i].tokens);
    if (head_rows[i] < 0 || head_rows[i] > static_cast<int64_t>(batch[i].tokens.size())) {
      fail(ErrorCode::usage, {}, "head rows outside the chunk");
    }
    for (size_t j = 0; j < i; ++j) {
      if (batch[j].sequence == batch[i].sequence) fail(ErrorCode::usage, {}, "a sequence twice in one batched forward");
    }
  }
  top_kernels_.check(Arch::cpu);
  Batch b;
  for (const Chunk& chunk : batch) b.add(chunk.sequence->length, chunk.tokens);
  const int64_t S = b.count, D = c.hidden_size;
  const HyperParams hp = hyper_params(c);
  const int64_t width = hp.hc * D;

  Buffer streams(static_cast<size_t>(S * width));  // [S, hc, D]: the embedding in every stream
  for (int64_t t = 0; t < S; ++t) {
    top_kernels_.embedding(*tensors_.embed, b.tokens[t], std::span(&streams[t * width], D));
    for (int j = 1; j < hp.hc; ++j) std::copy_n(&streams[t * width], D, &streams[t * width + j * D]);
  }
  if (extras.journal) extras.journal->assign(static_cast<size_t>(c.num_hidden_layers), {});
  std::vector<LayerState*> states(batch.size());
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerKernels& k = layer_kernels_[l];
    k.check(Arch::cpu);
    const Rope& rope = c.attention[l] == AttentionKind::sliding ? rope_main_ : rope_compress_;
    for (size_t i = 0; i < batch.size(); ++i) states[i] = &batch[i].sequence->layers[l];
    run_layer(b.step(c, k, rope, states), hp, tensors_.layers[l], streams,
              extras.journal ? &(*extras.journal)[l] : nullptr);
  }
  for (const Chunk& chunk : batch) chunk.sequence->length += static_cast<int64_t>(chunk.tokens.size());
  if (extras.streams) extras.streams->assign(streams.begin(), streams.end());

  // The head over each chunk's last head_rows rows, all at once, chunked by chunk.
  Buffer rows;
  std::vector<int64_t> chunks;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (head_rows[i] == 0) continue;
    const Part& p = b.parts[i];
    rows.insert(rows.end(), streams.begin() + (p.row + p.count - head_rows[i]) * width,
                streams.begin() + (p.row + p.count) * width);
    chunks.push_back(head_rows[i]);
  }
  int64_t n = 0;
  for (const int64_t rows_i : chunks) n += rows_i;
  const Buffer logits = n ? head_logits(c, hp, tensors_.hc_head, tensors_.norm, top_kernels_, top_kernels_,
                                        *tensors_.head, rows.data(), n, chunks)
                          : Buffer{};
  std::vector<std::vector<float>> out;
  int64_t at = 0;
  const int64_t V = c.vocab_size;
  for (size_t i = 0; i < batch.size(); ++i) {
    out.emplace_back(logits.begin() + at * V, logits.begin() + (at + head_rows[i]) * V);
    at += head_rows[i];
  }
  return out;
}

std::vector<float> Model::draft(Sequence& seq, std::span<const float> trunk_streams,
                                std::span<const int32_t> next_tokens, LogitRows which,
                                std::vector<float>* out_streams) const {
  if (!has_draft()) fail(ErrorCode::usage, {}, "this model has no MTP layer to draft with");
  const ModelConfig& c = config_;
  const HyperParams hp = hyper_params(c);
  const int64_t S = static_cast<int64_t>(next_tokens.size()), D = c.hidden_size, width = hp.hc * D;
  if (static_cast<int64_t>(trunk_streams.size()) != S * width) {
    fail(ErrorCode::usage, {}, "the MTP layer takes one row of trunk streams per next token");
  }
  check_tokens(c, seq.draft_length + 1, next_tokens);
  const MtpWeights& m = tensors_.mtp.front();
  const LayerKernels& k = draft_kernels_;
  k.check(Arch::cpu);
  draft_top_kernels_.check(Arch::cpu);
  const float eps = static_cast<float>(c.rms_norm_eps);
  // e = RMSNorm(embed[t_{i+1}]; enorm) · e_projᵀ, once per token.
  Buffer e(static_cast<size_t>(S * D));
  for (int64_t t = 0; t < S; ++t) {
    std::span<float> et(&e[t * D], D);
    draft_top_kernels_.embedding(*tensors_.embed, next_tokens[t], et);
    k.norm(et, m.enorm, eps, et);
  }
  const Buffer ep = project(k.linear_for(*m.e_proj), *m.e_proj, rows_of(std::span<const float>(e), D));
  // Each stream: RMSNorm(X; hnorm) · h_projᵀ, plus the token's e.
  Buffer streams(trunk_streams.begin(), trunk_streams.end());
  for (int64_t r = 0; r < S * hp.hc; ++r) {
    std::span<float> row(&streams[r * D], D);
    k.norm(row, m.hnorm, eps, row);
  }
  Buffer y = project(k.linear_for(*m.h_proj), *m.h_proj, rows_of(std::span<const float>(streams), D));
  for (int64_t t = 0; t < S; ++t) {
    for (int j = 0; j < hp.hc; ++j) {
      for (int64_t d = 0; d < D; ++d) y[(t * hp.hc + j) * D + d] += ep[t * D + d];
    }
  }
  const int layer = c.num_hidden_layers;
  const Rope& rope = c.attention[layer] == AttentionKind::sliding ? rope_main_ : rope_compress_;
  Batch b;
  b.add(seq.draft_length, next_tokens);
  LayerState* state = &seq.draft.front();
  run_layer(b.step(c, k, rope, std::span(&state, 1)), hp, m.block, y, nullptr);
  seq.draft_length += S;

  const int64_t first = which == LogitRows::last ? S - 1 : 0, n = S - first;
  if (out_streams) out_streams->assign(y.begin() + first * width, y.end());
  return head_logits(c, hp, m.hc_head, m.norm, k, draft_top_kernels_, *tensors_.head, &y[first * width], n);
}

SequenceMark Model::mark(const Sequence& seq, int64_t ahead) const {
  return mark_layers(seq.layers, seq.length, ahead, config_.sliding_window, config_.head_dim);
}

void Model::rewind(Sequence& seq, const SequenceMark& mark, const ForwardJournal& journal, int64_t keep) const {
  const ModelConfig& c = config_;
  if (journal.size() != seq.layers.size()) fail(ErrorCode::usage, {}, "a rewind needs the journal of the forward it undoes");
  restore_layers(seq.layers, mark, keep, c.sliding_window, c.head_dim);
  // The kept tokens' projections join the restored compressors again: the same windows
  // close into the same entries.
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const AttentionWeights& a = tensors_.layers[l].attn;
    const Rope& rope = c.attention[l] == AttentionKind::sliding ? rope_main_ : rope_compress_;
    const Step s{c, layer_kernels_[l], rope};  // appending needs no rows
    LayerState& st = seq.layers[l];
    if (a.compressor) append(s, *a.compressor, st.compressor, journal[l].compressor.kv.data(), journal[l].compressor.gate.data(), keep);
    if (a.indexer) {
      append(s, a.indexer->compressor, st.indexer, journal[l].indexer.kv.data(), journal[l].indexer.gate.data(), keep);
    }
  }
  seq.length = mark.length + keep;
}

SequenceMark Model::mark_draft(const Sequence& seq, int64_t ahead) const {
  return mark_layers(seq.draft, seq.draft_length, ahead, config_.sliding_window, config_.head_dim);
}

void Model::rewind_draft(Sequence& seq, const SequenceMark& mark) const {
  restore_layers(seq.draft, mark, 0, config_.sliding_window, config_.head_dim);
  seq.draft_length = mark.length;
}

}  // namespace keel
