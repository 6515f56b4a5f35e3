#include "model/model.h"

#include <algorithm>
#include <string>

#include "base/error.h"

namespace keel {
namespace {

uint64_t tensor_bytes(const Weight& w) { return w.data.nbytes() + (w.scale.data ? w.scale.nbytes() : 0); }

// Blocks one compressor may take for `n` more tokens: its new entries; the open window's
// new rows (when a window closes, up to `ratio` rows, then, after it is cleared, whose
// blocks stay held where a snapshot shares them, up to min(n, ratio - 1) rows again);
// the carried series rewritten; and a copy of each shared block it writes.
int64_t compressor_blocks(const CompressorState& st, int ratio, int64_t n) {
  const bool closes = st.pending + n >= ratio;
  int64_t blocks = st.entries.blocks_to_grow(st.count + (st.pending + n) / ratio, false);
  for (const PagedRows* r : {&st.pending_kv, &st.pending_gate}) {
    const int64_t per = r->rows_per_block();
    blocks += closes ? r->blocks_to_grow(ratio, false) + (std::min<int64_t>(n, ratio - 1) + per - 1) / per
                     : r->blocks_to_grow(st.pending + n, false);
  }
  if (closes) {
    for (const PagedRows* r : {&st.carry_kv, &st.carry_gate}) blocks += r->blocks_to_grow(ratio, true);
  }
  return blocks;
}

// Reads one byte per page so the checkpoint is in memory before the first token.
void prefault(const ModelWeights& weights, const Model::Progress& progress) {
  const uint64_t total = weights.stored_bytes();
  uint64_t done = 0, reported = 0;
  volatile uint8_t sink = 0;
  for (const TensorSpec& spec : weights.specs()) {
    const Weight& w = weights.at(spec.name);
    for (const TensorView* v : {&w.data, &w.scale}) {
      if (!v->data) continue;
      const auto* bytes = static_cast<const uint8_t*>(v->data);
      for (uint64_t i = 0; i < v->nbytes(); i += 4096) sink = sink + bytes[i];
      done += v->nbytes();
    }
    if (done - reported >= total / 100 || done == total) {
      progress(done, total);
      reported = done;
    }
  }
  progress(total, total);
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& directory, const Progress& progress,
                                   const BackendChoices& target, const BackendChoices& draft) {
  std::unique_ptr<Model> m(new Model);
  m->config_ = load_config(directory);
  m->plan_ = resolve_plan({.config = m->config_, .arch = Arch::cpu, .target = target, .draft = draft});
  m->top_kernels_ = bind_kernels(m->plan_, -1, ModelRole::target);
  for (int l = 0; l < m->config_.num_hidden_layers; ++l) {
    m->layer_kernels_.push_back(bind_kernels(m->plan_, l, ModelRole::target));
  }
  m->checkpoint_ = std::make_unique<Checkpoint>(Checkpoint::open(directory));
  m->weights_ = std::make_unique<ModelWeights>(ModelWeights::bind(*m->checkpoint_, m->config_));
  m->tensors_ = gather_tensors(*m->weights_, m->config_);
  if (m->has_draft()) {
    m->draft_kernels_ = bind_kernels(m->plan_, m->config_.num_hidden_layers, ModelRole::draft);
    m->draft_top_kernels_ = bind_kernels(m->plan_, -1, ModelRole::draft);
  }
  m->rope_main_ = Rope(m->config_.rope_main);
  m->rope_compress_ = Rope(m->config_.rope_compress);
  m->pool_ = std::make_shared<HostBlockPool>(m->state_block_floats());
  if (progress) prefault(*m->weights_, progress);
  return m;
}

Sequence Model::new_sequence(std::shared_ptr<HostBlockPool> pool) const {
  const ModelConfig& c = config_;
  if (!pool) pool = pool_;
  if (pool->block_floats() != state_block_floats()) fail(ErrorCode::usage, {}, "a state pool of another block size");
  const auto layer = [&](int l) {
    LayerState st;
    st.window = PagedRows(pool, c.head_dim);
    if (c.attention[l] == AttentionKind::heavily_compressed) st.compressor = CompressorState(pool, c.head_dim, false);
    if (c.attention[l] == AttentionKind::compressed_sparse) {
      st.compressor = CompressorState(pool, c.head_dim, true);
      st.indexer = CompressorState(pool, c.index_head_dim, true);
    }
    return st;
  };
  Sequence s;
  for (int l = 0; l < c.num_hidden_layers; ++l) s.layers.push_back(layer(l));
  if (has_draft()) s.draft.push_back(layer(c.num_hidden_layers));
  return s;
}

int64_t Model::blocks_needed(const Sequence& seq, int64_t tokens) const {
  const ModelConfig& c = config_;
  int64_t blocks = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerState& st = seq.layers[l];
    blocks += st.window.blocks_to_grow(c.sliding_window, true);
    const int m = c.compress_ratio(l);
    if (m == 0) continue;
    blocks += compressor_blocks(st.compressor, m, tokens);
    if (c.attention[l] == AttentionKind::compressed_sparse) blocks += compressor_blocks(st.indexer, m, tokens);
  }
  return blocks;
}

double Model::state_bytes_per_token() const {
  const ModelConfig& c = config_;
  double bytes = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const int m = c.compress_ratio(l);
    if (m == 0) continue;
    bytes += static_cast<double>(c.head_dim) * sizeof(float) / m;
    if (c.attention[l] == AttentionKind::compressed_sparse) bytes += static_cast<double>(c.index_head_dim) * sizeof(float) / m;
  }
  return bytes;
}

uint64_t Model::state_bytes_per_sequence() const {
  const ModelConfig& c = config_;
  const uint64_t f = sizeof(float), ring = uint64_t(c.sliding_window) * c.head_dim * f;
  // An open window holds up to m − 1 rows of kv and gate; CSA's are two series wide and
  // carry m rows of one series (kv and gate) into the next entry.
  const auto compressor = [&](int m, uint64_t dim, bool overlapping) {
    const uint64_t width = overlapping ? 2 * dim : dim;
    return 2 * (m - 1) * width * f + (overlapping ? 2 * uint64_t(m) * dim * f : 0);
  };
  uint64_t bytes = ring * (c.num_hidden_layers + (has_draft() ? 1 : 0));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const int m = c.compress_ratio(l);
    if (m == 0) continue;
    const bool csa = c.attention[l] == AttentionKind::compressed_sparse;
    bytes += compressor(m, c.head_dim, csa);
    if (csa) bytes += compressor(m, c.index_head_dim, true);
  }
  return bytes;
}

uint64_t Model::decode_bytes_per_token() const {
  const ModelConfig& c = config_;
  uint64_t bytes = tensor_bytes(*tensors_.head) + tensor_bytes(*tensors_.embed) / c.vocab_size;
  for (const TensorSpec& spec : weights_->specs()) {
    if (spec.layer >= c.num_hidden_layers || spec.role != TensorRole::linear) continue;
    if (spec.name.find(".experts.") != std::string::npos) continue;  // counted below
    if (spec.layer >= 0) bytes += tensor_bytes(weights_->at(spec.name));
  }
  for (const LayerWeights& l : tensors_.layers) {
    const ExpertWeights& e = l.ffn.experts.front();
    bytes += c.num_experts_per_tok * (tensor_bytes(*e.w1) + tensor_bytes(*e.w2) + tensor_bytes(*e.w3));
  }
  return bytes;
}

uint64_t Model::linear_macs_per_token() const {
  const ModelConfig& c = config_;
  const auto macs = [](const Weight& w) { return static_cast<uint64_t>(w.spec->shape[0] * w.spec->shape[1]); };
  uint64_t total = macs(*tensors_.head);
  for (const TensorSpec& spec : weights_->specs()) {
    if (spec.layer < 0 || spec.layer >= c.num_hidden_layers || spec.role != TensorRole::linear) continue;
    if (spec.name.find(".experts.") != std::string::npos) continue;  // counted below
    total += static_cast<uint64_t>(spec.shape[0] * spec.shape[1]);
  }
  for (const LayerWeights& l : tensors_.layers) {
    const ExpertWeights& e = l.ffn.experts.front();
    total += c.num_experts_per_tok * (macs(*e.w1) + macs(*e.w2) + macs(*e.w3));
  }
  return total;
}

}  // namespace keel
