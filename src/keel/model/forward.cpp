// Model::forward: dsv4-forward.md §3–§7 over a chunk of S new tokens. Matrix products
// run over the whole chunk; attention runs per token against the sequence's state
// plus the chunk's own keys, so a chunk of any size gives the logits of a full forward.
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

// What every step of one forward call needs.
struct Step {
  const ModelConfig& c;
  const LayerKernels& k;  // what the plan chose for this layer
  const Rope& rope;       // of the layer being run
  int64_t start;     // position of the chunk's first token
  int64_t count;     // S
  std::span<const int32_t> tokens;
  float eps() const { return static_cast<float>(c.rms_norm_eps); }
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
    for (int c = 0; c < dim; ++c) gate.push_back(g[c] + bias[c]);
  };
  const int half = w.overlapping ? dim : 0;  // CSA: this entry pools the second series
  if (w.overlapping && !st.carry_kv.empty()) {
    kv = st.carry_kv;
    gate = st.carry_gate;
  }
  for (int j = 0; j < m; ++j) {
    add_slot(&st.pending_kv[j * width + half], &st.pending_gate[j * width + half], &w.ape[j * width + half]);
  }
  if (w.overlapping) {  // the first series joins the next entry, bias included
    st.carry_kv.clear();
    st.carry_gate.clear();
    for (int j = 0; j < m; ++j) {
      const float* v = &st.pending_kv[j * width];
      st.carry_kv.insert(st.carry_kv.end(), v, v + dim);
      for (int c = 0; c < dim; ++c) st.carry_gate.push_back(st.pending_gate[j * width + c] + w.ape[j * width + c]);
    }
  }
  Buffer entry(dim);
  s.k.pool(kv, gate, static_cast<int>(kv.size() / dim), dim, entry);
  s.k.norm(entry, w.norm, s.eps(), entry);
  s.rope.apply(entry, st.count * m);  // an entry sits at its window's start
  st.entries.insert(st.entries.end(), entry.begin(), entry.end());
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
    st.pending_kv.insert(st.pending_kv.end(), &kv[t * width], &kv[(t + 1) * width]);
    st.pending_gate.insert(st.pending_gate.end(), &gate[t * width], &gate[(t + 1) * width]);
    if (++st.pending == w.ratio) close_window(s, w, st);
  }
}

// With `journal`, the projections are kept there too (for Model::rewind's replay).
void compress(const Step& s, const CompressorWeights& w, CompressorState& st, ConstRows x,
              CompressorJournal* journal) {
  Buffer kv = project(s, *w.wkv, x), gate = project(s, *w.wgate, x);
  append(s, w, st, kv.data(), gate.data(), s.count);
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
  r.q = project(s, *a.wq_b, rows_of(std::span<const float>(r.qr), c.q_lora_rank));
  r.kv = project(s, *a.wkv, x);
  norm_rows(s, r.kv, c.head_dim, a.kv_norm);
  const int64_t heads = c.num_attention_heads, hd = c.head_dim;
  for (int64_t t = 0; t < s.count; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::span<float> head(&r.q[(t * heads + h) * hd], hd);
      rms_norm_unweighted(head, s.eps());
      s.rope.apply(head, s.start + t);
    }
    s.rope.apply(std::span<float>(&r.kv[t * hd], hd), s.start + t);
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
  IndexQueries r{project(s, *w.wq_b, rows_of(std::span<const float>(qr), c.q_lora_rank)),
                 project(s, *w.weights_proj, x)};
  const int64_t stride = int64_t{c.index_n_heads} * c.index_head_dim;
  for (int64_t t = 0; t < s.count; ++t) {
    s.rope.apply_heads(std::span<float>(&r.q[t * stride], stride), c.index_head_dim, s.start + t);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.index_n_heads));
  for (float& v : r.weights) v *= scale;
  return r;
}

// Keys of the token at `position`: its sliding window, then the compressed entries it sees.
std::vector<const float*> key_set(const Step& s, const AttentionWeights& a, const LayerState& st,
                                  const Queries& qs, const IndexQueries* iq, int64_t position) {
  const ModelConfig& c = s.c;
  const int64_t hd = c.head_dim, sw = c.sliding_window;
  std::vector<const float*> keys;
  for (int64_t j = std::max<int64_t>(0, position - sw + 1); j <= position; ++j) {
    keys.push_back(j >= s.start ? &qs.kv[(j - s.start) * hd] : &st.window[(j % sw) * hd]);
  }
  if (!a.compressor) return keys;
  const int64_t visible = (position + 1) / a.compressor->ratio;
  const float* entries = st.compressor.entries.data();
  if (!a.indexer) {
    for (int64_t w = 0; w < visible; ++w) keys.push_back(entries + w * hd);
    return keys;
  }
  const int64_t t = position - s.start;
  const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
  const auto picked = s.k.index(std::span(&iq->q[t * nI * dI], nI * dI), std::span(&iq->weights[t * nI], nI),
                                     c.index_n_heads, c.index_head_dim, st.indexer.entries, visible, c.index_topk);
  for (int64_t w : picked) keys.push_back(entries + w * hd);
  return keys;
}

void remember_window(const Step& s, LayerState& st, const Buffer& kv) {
  const int64_t hd = s.c.head_dim, sw = s.c.sliding_window;
  for (int64_t p = std::max(s.start, s.start + s.count - sw); p < s.start + s.count; ++p) {
    std::copy_n(&kv[(p - s.start) * hd], hd, &st.window[(p % sw) * hd]);
  }
}

Buffer attention(const Step& s, const AttentionWeights& a, LayerState& st, ConstRows x, LayerJournal* journal) {
  const ModelConfig& c = s.c;
  const int64_t H = c.num_attention_heads, hd = c.head_dim;
  const Queries qs = queries(s, a, x);
  if (a.compressor) compress(s, *a.compressor, st.compressor, x, journal ? &journal->compressor : nullptr);
  IndexQueries iq;
  if (a.indexer) {
    compress(s, a.indexer->compressor, st.indexer, x, journal ? &journal->indexer : nullptr);
    iq = index_queries(s, *a.indexer, qs.qr, x);
  }
  if (st.window.empty()) st.window.resize(static_cast<size_t>(c.sliding_window * hd));

  Buffer o(static_cast<size_t>(s.count * H * hd));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp parallel for schedule(dynamic, 1) if (s.count > 1)
  for (int64_t t = 0; t < s.count; ++t) {
    const auto keys = key_set(s, a, st, qs, a.indexer ? &iq : nullptr, s.start + t);
    std::span<float> out(&o[t * H * hd], H * hd);
    const auto attend = s.count == 1 ? s.k.attend_decode : s.k.attend_prefill;
    attend(std::span(&qs.q[t * H * hd], H * hd), H, hd, keys, a.sinks, scale, out);
    s.rope.apply_heads(out, hd, s.start + t, /*inverse=*/true);  // V carried K's rotation
  }
  remember_window(s, st, qs.kv);

  // Grouped output projection: group g's heads through rows [g·r, (g+1)·r) of wo_a.
  const int64_t G = c.o_groups, r = c.o_lora_rank, group_in = H * hd / G;
  Buffer u(static_cast<size_t>(s.count * G * r));
  for (int64_t g = 0; g < G; ++g) {
    s.k.linear_for(*a.wo_a)(*a.wo_a, ConstRows{o.data() + g * group_in, s.count, H * hd},
                            Rows{u.data() + g * r, s.count, G * r}, RowRange{g * r, r});
  }
  return project(s, *a.wo_b, rows_of(std::span<const float>(u), G * r));
}

// --- MoE (§6) ----------------------------------------------------------------------------

// acc.row(t) += weight_t · down(clamped_swiglu(gate(x_t), up(x_t))) for the rows `rows`;
// routed experts through the plan's MoE kernel, the shared expert through its dense one.
void run_expert(const Step& s, const ExpertWeights& e, bool routed, ConstRows x, const std::vector<int64_t>& rows,
                const std::vector<float>& weights, Buffer& acc) {
  const int64_t D = s.c.hidden_size, I = s.c.moe_intermediate_size, n = static_cast<int64_t>(rows.size());
  Buffer xs(static_cast<size_t>(n * D));
  for (int64_t i = 0; i < n; ++i) std::copy_n(x.row(rows[i]), D, &xs[i * D]);
  const ConstRows in = rows_of(std::span<const float>(xs), D);
  const auto kernel = [&](const Weight& w) { return routed ? s.k.expert_for(w) : s.k.linear_for(w); };
  Buffer g = project(kernel(*e.w1), *e.w1, in);
  const Buffer u = project(kernel(*e.w3), *e.w3, in);
  clamped_swiglu(g, u, static_cast<float>(s.c.swiglu_limit));
  const Buffer y = project(kernel(*e.w2), *e.w2, rows_of(std::span<const float>(g), I));
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
  const Buffer y = sublayer(rows_of(std::span<const float>(x), D));
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

// The logits of `n` rows of streams ([n, hc, D]) through a head (hc_head, norm, lm_head).
Buffer head_logits(const ModelConfig& c, const HyperParams& hp, const HyperHead& hc_head, std::span<const float> norm,
                   const LayerKernels& k, const LayerKernels& head_kernels, const Weight& head, const float* streams,
                   int64_t n) {
  const int64_t D = c.hidden_size, width = hp.hc * D;
  Buffer h(static_cast<size_t>(n * D));
  for (int64_t t = 0; t < n; ++t) {
    std::span<float> ht(&h[t * D], D);
    hyper_head(hp, hc_head, std::span(streams + t * width, width), ht);
    k.norm(ht, norm, static_cast<float>(c.rms_norm_eps), ht);
  }
  Buffer logits(static_cast<size_t>(n * c.vocab_size));
  head_kernels.linear_for(head)(head, rows_of(std::span<const float>(h), D),
                                rows_of(std::span<float>(logits), c.vocab_size), {});
  return logits;
}

// One decoder layer over the chunk's streams.
void run_layer(const Step& s, const HyperParams& hp, const LayerWeights& L, LayerState& st, Buffer& streams,
               LayerJournal* journal) {
  hyper_block(s, hp, L.hc_attn, L.attn_norm, streams, [&](ConstRows x) { return attention(s, L.attn, st, x, journal); });
  hyper_block(s, hp, L.hc_ffn, L.ffn_norm, streams, [&](ConstRows x) { return moe(s, L.ffn, x); });
}

}  // namespace

std::vector<float> Model::forward(Sequence& seq, std::span<const int32_t> tokens, LogitRows which,
                                  const ForwardExtras& extras) const {
  const ModelConfig& c = config_;
  check_tokens(c, seq.length, tokens);
  top_kernels_.check(Arch::cpu);
  const int64_t S = static_cast<int64_t>(tokens.size()), D = c.hidden_size;
  const HyperParams hp = hyper_params(c);
  const int64_t width = hp.hc * D;

  Buffer streams(static_cast<size_t>(S * width));  // [S, hc, D]: the embedding in every stream
  for (int64_t t = 0; t < S; ++t) {
    top_kernels_.embedding(*tensors_.embed, tokens[t], std::span(&streams[t * width], D));
    for (int j = 1; j < hp.hc; ++j) std::copy_n(&streams[t * width], D, &streams[t * width + j * D]);
  }
  if (extras.journal) extras.journal->assign(static_cast<size_t>(c.num_hidden_layers), {});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerKernels& k = layer_kernels_[l];
    k.check(Arch::cpu);
    const Rope& rope = c.attention[l] == AttentionKind::sliding ? rope_main_ : rope_compress_;
    const Step s{c, k, rope, seq.length, S, tokens};
    run_layer(s, hp, tensors_.layers[l], seq.layers[l], streams, extras.journal ? &(*extras.journal)[l] : nullptr);
  }
  seq.length += S;

  const int64_t first = which == LogitRows::last ? S - 1 : 0, n = S - first;
  if (extras.streams) extras.streams->assign(streams.begin(), streams.end());
  return head_logits(c, hp, tensors_.hc_head, tensors_.norm, top_kernels_, top_kernels_, *tensors_.head,
                     &streams[first * width], n);
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
  const Step s{c, k, rope, seq.draft_length, S, next_tokens};
  run_layer(s, hp, m.block, seq.draft.front(), y, nullptr);
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
    const Step s{c, layer_kernels_[l], rope, mark.length, keep, {}};
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
