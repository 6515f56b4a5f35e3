// The GPU forward pass: model/forward.cpp step by step, on device buffers. Kernel
// launches go through the entries the plan bound for each layer; the data movement in
// between is cudaMemcpy and cuda/forward_ops.h.
#include "cuda/gpu_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "base/error.h"
#include "cuda/attention.h"
#include "cuda/compressor.h"
#include "cuda/device.h"
#include "cuda/embedding.h"
#include "cuda/forward_ops.h"
#include "cuda/gemm_mma.h"
#include "cuda/indexer.h"
#include "cuda/mhc.h"
#include "cuda/moe.h"
#include "cuda/moe_routing.h"
#include "cuda/norm.h"
#include "cuda/sampling.h"
#include "cuda/staging.h"

namespace keel::cuda {

// The entry points the plan chose for one layer (or the top level), as model/kernels.h
// does for the CPU, with the CUDA launchers' signatures (bound by bind_common).
struct GpuModel::Kernels {
  using Linear = void(const DeviceWeight&, const float*, float*, int64_t, void*);
  std::array<Linear*, 5> gemm{};     // by planned WeightFormat (lm_head at top level)
  std::array<decltype(&linear_pairs), 5> experts{};  // moe_gemm: (token, routed expert) pairs
  decltype(&cuda::embed) embedding = nullptr;
  decltype(&cuda::attend_decode) attend_prefill = nullptr;
  decltype(&cuda::attend_decode) attend_decode = nullptr;
  decltype(&cuda::attend_decode) attend_verify = nullptr;  // planned where the model has an MTP layer
  decltype(&cuda::pool_slots) pool = nullptr;
  decltype(&cuda::indexer_select) index = nullptr;
  decltype(&cuda::hyper_in) mix = nullptr;  // an mHC site's mix, collapse and input norm
  decltype(&cuda::rms_norm) norm = nullptr;
  decltype(&cuda::route) routing = nullptr;
  decltype(&cuda::summarize_rows) sample = nullptr;  // null: the host summarizes (the plan's "host" sampler)
  std::vector<const KernelInfo*> used;

  void check(Arch running) const {
    for (const KernelInfo* k : used) check_runs_on(*k, running);
  }
};

// A weight on the device with the format the plan chose its kernel by (the schema's:
// a float tensor stored as f32 where the schema says bf16 is planned as bf16).
struct DeviceLinear {
  DeviceWeight w;
  WeightFormat planned = WeightFormat::bf16;
};

struct DeviceSite {
  DeviceBuffer<float> fn, base, scale;
};

struct DeviceCompressor {
  DeviceLinear wkv, wgate;
  DeviceBuffer<float> ape, norm;
  int ratio = 0, dim = 0;
  bool overlapping = false;
  int width() const { return overlapping ? 2 * dim : dim; }
};

struct DeviceExpert {
  DeviceLinear w1, w2, w3;
};

namespace {

GpuModel::Kernels bind_layer(const Plan& plan, int layer, ModelRole role = ModelRole::target) {
  GpuModel::Kernels k;
  bind_common(k, plan, layer, role);
  bind_entry(k.used, plan, layer, role, Op::moe_routing, k.routing);
  bind_entry(k.used, plan, layer, role, Op::attention_verify, k.attend_verify);
  // Sampling is the device kernel when the plan chose it; the plan's "host" sampler is
  // the CPU's over rows copied back.
  const PlanEntry* sampling = layer < 0 ? plan.find(layer, role, Op::sampling) : nullptr;
  if (sampling && sampling->kernel->has_entry<decltype(cuda::summarize_rows)>()) {
    bind_entry(k.used, plan, layer, role, Op::sampling, k.sample);
  }
  return k;
}

// Rows [first, first + count) of a weight, as a weight of its own (no copy). FP8 block
// scales cover 128 stored rows each, so the view keeps the scales and its row offset.
DeviceWeight weight_rows(const DeviceWeight& w, int64_t first, int64_t count) {
  DeviceWeight v = w;
  v.out = count;
  const auto* data = static_cast<const uint8_t*>(w.data);
  switch (w.format) {
    case WeightFormat::f32:
    case WeightFormat::bf16: v.data = data + first * w.in * (w.dtype == DType::f32 ? 4 : 2); break;
    case WeightFormat::fp8_block:
      v.data = data + first * w.in;
      v.first_row = w.first_row + first;
      break;
    case WeightFormat::mxfp4:
      v.data = data + first * w.in / 2;
      v.scale = w.scale + first * w.in / 32;
      break;
    case WeightFormat::nvfp4:
      v.data = data + first * w.in / 2;
      v.scale = w.scale + first * w.in / 16;
      break;
  }
  return v;
}

void upload_floats(DeviceBuffer<float>& d, const std::vector<float>& host) { d.assign(std::span<const float>(host)); }

}  // namespace

// Optional time per stage of the forward pass (keel bench --profile): an event at the
// start of each stage on the stream; after the call's final synchronization, the time
// up to the next event is the stage's (kernels, copies and any gap where the GPU waited
// for the host).
class StageTimer {
 public:
  StageTimer() = default;
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;
  ~StageTimer() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void mark(const char* stage, cudaStream_t stream) {
    if (used_ == 0) call_start_ = std::chrono::steady_clock::now();
    if (used_ == events_.size()) {
      cudaEvent_t e;
      check_api(cudaEventCreate(&e), "cudaEventCreate");
      events_.push_back(e);
    }
    check_api(cudaEventRecord(events_[used_], stream), "cudaEventRecord");
    stages_.resize(used_ + 1);
    stages_[used_++] = stage;
  }
  // Host time from the call's first mark until now: what enqueueing the call took.
  double host_seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start_).count();
  }
  // Adds the marked stages' times into `totals` (the last mark ends the call).
  void collect(std::map<std::string, double>& totals) {
    for (size_t i = 0; i + 1 < used_; ++i) {
      float ms = 0;
      check_api(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]), "cudaEventElapsedTime");
      totals[stages_[i]] += ms * 1e-3;
    }
    used_ = 0;
  }

 private:
  std::vector<cudaEvent_t> events_;
  std::vector<const char*> stages_;
  size_t used_ = 0;
  std::chrono::steady_clock::time_point call_start_;
};

struct GpuModel::Layer {
  AttentionKind kind = AttentionKind::sliding;
  DeviceSite hc_attn, hc_ffn;
  DeviceBuffer<float> attn_norm, ffn_norm, q_norm, kv_norm, sinks;
  DeviceLinear wq_a, wq_b, wkv, wo_a, wo_b;
  DeviceBuffer<DeviceWeight> wo_a_groups;  // wo_a's row groups, as views
  DeviceWeight wo_a_group0;
  std::optional<DeviceCompressor> compressor, index_compressor;
  DeviceLinear index_wq_b, index_weights;
  DeviceLinear gate;
  DeviceBuffer<float> bias;
  const std::vector<int32_t>* tid2eid = nullptr;  // hash layers (host)
  int hash_slot = -1;  // hash layers: which of the call's looked-up expert tables is theirs
  // Routed experts by id, one device table per projection (entries without data: held
  // by another rank), and one held expert's weights for the shapes and formats.
  DeviceBuffer<DeviceWeight> w1s, w2s, w3s;
  DeviceExpert like;
  bool holds_any = false;
  DeviceExpert shared;
};

// The MTP layer's weights besides its block (dsv4-forward.md §8).
struct GpuModel::Mtp {
  DeviceLinear e_proj, h_proj;
  DeviceBuffer<float> enorm, hnorm, norm, hc_fn, hc_base, hc_scale;
};

// A second stream for work that may run beside the main stream's: forked from it and
// joined back within one sublayer, so that a decode graph's capture holds both ends.
struct GpuModel::SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  SideStream() {
    check_api(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    for (cudaEvent_t* e : {&fork, &join}) {
      check_api(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (stream) cudaStreamSynchronize(stream);
    for (cudaEvent_t e : {fork, join}) {
      if (e) cudaEventDestroy(e);
    }
    if (stream) cudaStreamDestroy(stream);
  }
  // The side stream starts after what `main` has enqueued so far.
  void start(cudaStream_t main) const {
    check_api(cudaEventRecord(fork, main), "cudaEventRecord");
    check_api(cudaStreamWaitEvent(stream, fork, 0), "cudaStreamWaitEvent");
  }
  // `main` goes on after what the side stream has enqueued so far.
  void rejoin(cudaStream_t main) const {
    check_api(cudaEventRecord(join, stream), "cudaEventRecord");
    check_api(cudaStreamWaitEvent(main, join, 0), "cudaStreamWaitEvent");
  }
};

// Page-locked host memory for what comes back (logits, sampling summaries), grown as
// needed.
template <typename T>
struct Pinned {
  T* data = nullptr;
  size_t size = 0;
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (data) cudaFreeHost(data);
  }
  T* grow(size_t n) {
    if (n > size) {
      if (data) cudaFreeHost(data);
      data = nullptr;
      size = 0;
      check_api(cudaMallocHost(reinterpret_cast<void**>(&data), n * sizeof(T)), "cudaMallocHost");
      size = n;
    }
    return data;
  }
  void swap(Pinned& other) noexcept {
    std::swap(data, other.data);
    std::swap(size, other.size);
  }
};

// Intermediate buffers, grown as needed and kept between calls.
struct GpuModel::Workspace {
  Pinned<float> logits_host;
  Pinned<uint8_t> sample_host;
  Staging stage;
  // The previous call's, which may not have run yet (pipelined decode): each call turns.
  Pinned<uint8_t> spare_sample_host;
  Staging spare_stage;
  void turn() {
    sample_host.swap(spare_sample_host);
    stage.swap(spare_stage);
    stage.reset();
  }
  std::unique_ptr<StageTimer> timer;  // when profiling
  DeviceBuffer<int32_t> tokens;
  DeviceBuffer<int64_t> positions;
  DeviceBuffer<float> streams, x, y, pre, post, comb, mix_scratch;
  DeviceBuffer<unsigned> mix_arrivals, attention_arrivals;  // kernels' counters: zero between their launches
  DeviceBuffer<float> qr, q, o, attention_scratch, group_in, group_out, u, index_q, index_w, index_scores;
  DeviceBuffer<float> kv, proj_kv, proj_gate, index_kv, index_gate, slot_values, slot_gates;
  DeviceBuffer<int32_t> group_ids;
  DeviceBuffer<float> scores, route_weights, g, up, expert_out, shared_g, shared_up, shared_out, head_streams, head_in;
  DeviceBuffer<float> logits, head_scratch;
  DeviceBuffer<int32_t> route_experts, hashed, pair_scratch;
  DeviceBuffer<int32_t> pick_sources;  // a pipelined call's rows: cuda::pick_source of the call before, or -1
  struct ClosingBuffers {  // one compressor's gathered rows and pooled entries (close_windows)
    DeviceBuffer<float> kv, gate, pooled;
  };
  ClosingBuffers closing[2];  // the compressor's and the indexer's, both planned before either runs
  DeviceBuffer<uint8_t> sample_out;  // RowTotals[rows], ids and values [rows, stride], the kernels' scratch
};

namespace {

float* grow(DeviceBuffer<float>& b, int64_t n) {
  b.resize(static_cast<size_t>(n));
  return b.data();
}

// At least n counters of a kernel that leaves them zero: those added start at zero.
unsigned* grow_counters(DeviceBuffer<unsigned>& b, int64_t n, cudaStream_t stream) {
  if (const size_t had = b.size(); had < static_cast<size_t>(n)) {
    b.resize(static_cast<size_t>(n));
    check_api(cudaMemsetAsync(b.data() + had, 0, (n - had) * sizeof(unsigned), stream), "cudaMemsetAsync");
  }
  return b.data();
}

// `to` becomes a copy of `count` floats at `from` (device memory), asynchronously.
void copy_into(DeviceBuffer<float>& to, const float* from, int64_t count, cudaStream_t stream) {
  float* dst = grow(to, count);
  if (count) check_api(cudaMemcpyAsync(dst, from, count * sizeof(float), cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
}

// What every step of one forward call shares (model/forward.cpp's Step). A call's rows
// are the tokens of every chunk in the batch, chunk after chunk.
struct Step {
  const ModelConfig& c;
  const ExpertShare& share;
  const GpuModel::Kernels& k;
  const DeviceRope& rope;
  GpuModel::Workspace& ws;
  cudaStream_t stream;
  int64_t count;  // rows (in a decode graph's step, padded to its bucket)
  DeviceJournal* journal = nullptr;  // speculative verification: keeps the compressors' inputs
  const GpuModel::SideStream* side = nullptr;  // null: everything on `stream`
  float eps() const { return static_cast<float>(c.rms_norm_eps); }

  // y = x·Wᵀ through the plan's kernel for the weight's planned format.
  void linear(const DeviceLinear& w, const float* x, float* y, int64_t rows) const {
    auto* kernel = k.gemm[static_cast<size_t>(w.planned)];
    if (!kernel) fail(ErrorCode::kernel_plan, {}, "no GPU kernel was planned for a weight of this format");
    kernel(w.w, x, y, rows, stream);
  }
  // Several projections of the same x, each into its buffer (grown to fit): those the
  // plan put on the tensor-core GEMM as one group (linear_mma_group: one launch for a
  // decode step's rows, the same bits as one by one), the others one by one.
  struct Projection {
    const DeviceLinear* w;
    DeviceBuffer<float>* out;
  };
  void project_all(std::span<const Projection> projections, const float* x) const {
    std::vector<GemmProduct> group;
    for (const Projection& p : projections) {
      float* y = grow(*p.out, count * p.w->w.out);
      if (k.gemm[static_cast<size_t>(p.w->planned)] == &cuda::linear_mma) {
        group.push_back({&p.w->w, y});
      } else {
        linear(*p.w, x, y, count);
      }
    }
    linear_mma_group(group, x, count, stream);
  }
  void mark(const char* stage) const {
    if (ws.timer) ws.timer->mark(stage, stream);
  }
  void copy(void* dst, const void* src, size_t bytes) const {
    if (bytes) check_api(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  }
};

// One sequence's rows of a call: rows [row, row + count), at positions start, start + 1, ...
struct Part {
  DeviceSequence* sequence;
  int64_t start, row, count;
};

constexpr size_t kF = sizeof(float);
constexpr int64_t kAttentionScratch = int64_t{256} << 20;  // bytes of split-key partial sums at most

// Copy jobs staged for one launch after the stage's next flush.
struct StagedCopies {
  const CopyJob* jobs = nullptr;
  int64_t n = 0, longest = 0;
  void run(cudaStream_t stream) const { copy_batch(jobs, n, longest, stream); }
};

// Stages `jobs` (then clears them).
StagedCopies stage_copies(Staging& stage, std::vector<CopyJob>& jobs) {
  StagedCopies out{stage.stage(std::span<const CopyJob>(jobs)), static_cast<int64_t>(jobs.size())};
  for (const CopyJob& j : jobs) out.longest = std::max(out.longest, j.count);
  jobs.clear();
  return out;
}

// Runs `jobs` in one launch now, on `stream` (then clears them).
void copy_now(Staging& stage, std::vector<CopyJob>& jobs, cudaStream_t stream) {
  if (jobs.empty()) return;
  const StagedCopies staged = stage_copies(stage, jobs);
  stage.flush(stream);
  staged.run(stream);
}

// A job that puts `values` into `to` (resized to fit), as 4-byte words: ids and
// positions move as their bits.
template <typename T>
void add_upload(std::vector<CopyJob>& jobs, Staging& stage, DeviceBuffer<T>& to, std::span<const T> values) {
  static_assert(sizeof(T) % sizeof(float) == 0);
  to.resize(values.size());
  if (values.empty()) return;
  jobs.push_back({reinterpret_cast<float*>(to.data()), reinterpret_cast<const float*>(stage.stage(values)),
                  static_cast<int64_t>(values.size_bytes() / sizeof(float))});
}

// --- Compressors: the windows this chunk closes become entries (§5.6, §5.7) ---------------

// The compressor windows that close in one step, over every sequence of the batch,
// for one compressor of one layer. Each sequence's rows (the previous window for CSA,
// the open window, the chunk) are gathered into one buffer; all windows are pooled,
// normed and roped in one launch each; each entry and each sequence's new open window
// go back to its own buffers. The launches per step do not grow with the number of
// sequences, and a window's entry is the same bits whatever else closes beside it.
struct ClosingWindows {
  struct Rows {  // state or chunk rows gathered at row `at` of the buffer
    int64_t at;
    const float *kv, *gate;
    int64_t count;
  };
  struct Window {
    int64_t start;  // its first row in the buffer
    float* out;     // its entry's row in the sequence's buffer
    int64_t position;
  };
  struct Keep {  // state rows refilled from the buffer: the new open window, CSA's previous
    float *kv, *gate;
    int64_t at, count;
  };
  std::vector<Rows> gather;
  std::vector<Window> lone, rest;  // CSA's first window (no previous series), the others
  std::vector<Keep> keep;
  int64_t rows = 0;

  // Rows [0, count) of a state's kv and gate (paged alike) gathered at row `at`, a run
  // per block.
  void gather_state(int64_t at, const DevicePagedRows& kv, const DevicePagedRows& gate, int64_t count) {
    const int64_t per = kv.rows_per_block();
    for (int64_t i = 0; i < count; i += per) {
      gather.push_back({at + i, kv.row(i), gate.row(i), std::min(per, count - i)});
    }
  }
  // Rows [0, count) of a state's kv and gate refilled from row `at`, a run per block.
  void keep_state(DevicePagedRows& kv, DevicePagedRows& gate, int64_t at, int64_t count) {
    const int64_t per = kv.rows_per_block();
    for (int64_t i = 0; i < count; i += per) keep.push_back({kv.write_row(i), gate.write_row(i), at + i, std::min(per, count - i)});
  }
};

// Copy jobs for rows [first, first + n) of `rows` from `src` ([n, width]), one per run
// of rows within a block (copying a shared block first).
void copy_rows_in(DevicePagedRows& rows, int64_t first, const float* src, int64_t n, std::vector<CopyJob>& jobs) {
  const int64_t per = rows.rows_per_block(), width = rows.width();
  for (int64_t i = first; i < first + n;) {
    const int64_t run = std::min(first + n, (i / per + 1) * per) - i;
    jobs.push_back({rows.write_row(i), src + (i - first) * width, run * width});
    i += run;
  }
}

// What a sequence's `n` new token rows make `w` close: the windows, and the rows their
// closing gathers (the previous window for CSA, the open one, the new rows); none of
// either when no window closes.
struct Closing {
  int64_t windows = 0, rows = 0;
};
Closing closing_of(const DeviceCompressor& w, const DeviceCompressorState& st, int64_t n) {
  if (st.pending + n < w.ratio) return {};
  return {(st.pending + n) / w.ratio, (w.overlapping && st.count > 0 ? w.ratio : 0) + st.pending + n};
}

// One sequence's `n` token projections kv, gate ([n, width]) join its compressor: rows
// that close no window join the open one through `jobs` (run later in one launch); the
// windows they close are planned in `closing`, whose entries become rows of `entries`.
// The state's counts change now; its rows when `closing` runs.
void compress(const DeviceCompressor& w, DeviceCompressorState& st, const float* kv, const float* gate, int64_t n,
              DevicePagedRows& entries, std::vector<CopyJob>& jobs, ClosingWindows& closing) {
  const int m = w.ratio;
  st.pending_kv.resize(m);
  st.pending_gate.resize(m);
  const auto [windows, rows] = closing_of(w, st, n);
  if (windows == 0) {  // no window closes (most decode steps): the rows join the open one
    copy_rows_in(st.pending_kv, st.pending, kv, n, jobs);
    copy_rows_in(st.pending_gate, st.pending, gate, n, jobs);
    st.pending += static_cast<int>(n);
    return;
  }
  // The token rows in order: the previous window (CSA), the open window, this chunk.
  const int64_t before = rows - st.pending - n, base = closing.rows;
  closing.rows += rows;
  closing.gather_state(base, st.previous_kv, st.previous_gate, before);
  closing.gather_state(base + before, st.pending_kv, st.pending_gate, st.pending);
  closing.gather.push_back({base + before + st.pending, kv, gate, n});
  // CSA's first window has no previous series: ratio slots instead of 2·ratio.
  const bool lone = w.overlapping && st.count == 0;
  entries.resize(st.count + windows);
  for (int64_t i = 0; i < windows; ++i) {  // an entry sits at its window's start
    const ClosingWindows::Window window{base + before + i * m, entries.write_row(st.count + i), (st.count + i) * m};
    (i == 0 && lone ? closing.lone : closing.rest).push_back(window);
  }
  if (w.overlapping) {
    st.previous_kv.resize(m);
    st.previous_gate.resize(m);
    closing.keep_state(st.previous_kv, st.previous_gate, base + before + (windows - 1) * m, m);
  }
  st.count += windows;
  const int64_t done = before + windows * m;
  st.pending = static_cast<int>(rows - done);
  closing.keep_state(st.pending_kv, st.pending_gate, base + done, st.pending);
}

// What `closing` planned for one compressor, ready to run after the stage's flush: its
// copy jobs, window starts and positions staged, its buffers sized.
struct ClosingRun {
  const DeviceCompressor* w = nullptr;  // null: no window closes
  StagedCopies gather, out;             // rows into the buffer; entries and kept rows out of it
  const int64_t *starts = nullptr, *positions = nullptr;
  float *all_kv = nullptr, *all_gate = nullptr, *pooled = nullptr;
  int64_t lone = 0, total = 0;  // windows: CSA's first ones, then all

  void run(const Step& s) const {
    if (!w) return;
    const int m = w->ratio, dim = w->dim;
    gather.run(s.stream);
    const auto pool = [&](int64_t first, int64_t count, bool previous) {
      if (count == 0) return;
      const int slots = previous ? 2 * m : m;
      float* values = grow(s.ws.slot_values, count * slots * dim);
      float* gates = grow(s.ws.slot_gates, count * slots * dim);
      compressor_slots(all_kv, all_gate, w->ape.data(), w->width(), dim, m, w->overlapping, 0, count, previous, values,
                       gates, s.stream, starts + first);
      s.k.pool(values, gates, count, slots, dim, pooled + first * dim, s.stream);
    };
    pool(0, lone, false);
    pool(lone, total - lone, w->overlapping);
    s.k.norm(pooled, w->norm.data(), s.eps(), pooled, total, dim, s.stream);
    cuda::rope(s.rope, pooled, total, 1, dim, positions, false, s.stream);
    out.run(s.stream);
  }
};

ClosingRun plan_closing(Staging& stage, const DeviceCompressor& w, const ClosingWindows& closing,
                        GpuModel::Workspace::ClosingBuffers& buffers) {
  ClosingRun r;
  r.lone = static_cast<int64_t>(closing.lone.size());
  r.total = r.lone + static_cast<int64_t>(closing.rest.size());
  if (r.total == 0) return r;
  r.w = &w;
  const int64_t width = w.width();
  r.all_kv = grow(buffers.kv, closing.rows * width);
  r.all_gate = grow(buffers.gate, closing.rows * width);
  r.pooled = grow(buffers.pooled, r.total * w.dim);
  std::vector<CopyJob> jobs;
  for (const auto& g : closing.gather) {
    if (g.count == 0) continue;
    jobs.push_back({r.all_kv + g.at * width, g.kv, g.count * width});
    jobs.push_back({r.all_gate + g.at * width, g.gate, g.count * width});
  }
  r.gather = stage_copies(stage, jobs);
  std::vector<int64_t> starts, positions;
  for (const auto* group : {&closing.lone, &closing.rest}) {
    for (const auto& window : *group) {
      starts.push_back(window.start);
      positions.push_back(window.position);
      jobs.push_back({window.out, r.pooled + (static_cast<int64_t>(starts.size()) - 1) * w.dim, w.dim});
    }
  }
  r.starts = stage.stage(std::span<const int64_t>(starts));
  r.positions = stage.stage(std::span<const int64_t>(positions));
  for (const auto& k : closing.keep) {
    if (k.count == 0) continue;
    jobs.push_back({k.kv, r.all_kv + k.at * width, k.count * width});
    jobs.push_back({k.gate, r.all_gate + k.at * width, k.count * width});
  }
  r.out = stage_copies(stage, jobs);
  return r;
}

// The buffers a layer's closing windows use (its compressor's in closing[0], its
// indexer's in closing[1], the pooling slots in slot_values and slot_gates), grown for
// what `parts` close: a decode step grows them for each layer of a piece before it plans
// any, since a plan's staged copies point into them.
void reserve_closing(const Step& s, const GpuModel::Layer& L, int layer, std::span<const Part> parts) {
  GpuModel::Workspace& ws = s.ws;
  const auto reserve = [&](const DeviceCompressor& w, auto state_of, GpuModel::Workspace::ClosingBuffers& buffers) {
    int64_t rows = 0, windows = 0;
    for (const Part& part : parts) {
      const Closing c = closing_of(w, state_of(part.sequence->layers[layer]), part.count);
      rows += c.rows;
      windows += c.windows;
    }
    if (windows == 0) return;
    grow(buffers.kv, rows * w.width());
    grow(buffers.gate, rows * w.width());
    grow(buffers.pooled, windows * w.dim);
    const int64_t slots = w.overlapping ? 2 * w.ratio : w.ratio;
    grow(ws.slot_values, windows * slots * w.dim);  // a smaller size keeps the capacity
    grow(ws.slot_gates, windows * slots * w.dim);
  };
  if (L.compressor) reserve(*L.compressor, [](const DeviceLayerState& st) -> const auto& { return st.compressor; }, ws.closing[0]);
  if (L.index_compressor) {
    reserve(*L.index_compressor, [](const DeviceLayerState& st) -> const auto& { return st.indexer; }, ws.closing[1]);
  }
}

// One sequence's rows for a layer's compressors: `n` rows of each one's kv and gate
// projections (null without it).
struct CompressorRows {
  DeviceLayerState* st;
  const float *kv, *gate, *index_kv, *index_gate;
  int64_t n;
};

// A layer's compressor work in one call, over every sequence: planned (the states'
// counts advance now, the values are staged), then run after the stage's flush: the
// windows that close become entries, the other rows join their open windows.
struct CompressorWork {
  ClosingRun windows, index_windows;
  StagedCopies rows_in;
  void run(const Step& s) const {
    windows.run(s);
    index_windows.run(s);
    rows_in.run(s.stream);
  }
};

CompressorWork plan_compressors(const Step& s, const GpuModel::Layer& L, std::span<const CompressorRows> rows) {
  std::vector<CopyJob> jobs;
  ClosingWindows closing, index_closing;
  for (const CompressorRows& r : rows) {
    if (L.compressor) compress(*L.compressor, r.st->compressor, r.kv, r.gate, r.n, r.st->entries, jobs, closing);
    if (L.index_compressor) {
      compress(*L.index_compressor, r.st->indexer, r.index_kv, r.index_gate, r.n, r.st->index_keys, jobs, index_closing);
    }
  }
  CompressorWork work;
  if (L.compressor) work.windows = plan_closing(s.ws.stage, *L.compressor, closing, s.ws.closing[0]);
  if (L.index_compressor) work.index_windows = plan_closing(s.ws.stage, *L.index_compressor, index_closing, s.ws.closing[1]);
  work.rows_in = stage_copies(s.ws.stage, jobs);
  return work;
}

// --- Attention (§5) ------------------------------------------------------------------------

// Each part's keys are rows of one block table (cuda/paged_rows.h) of head_dim rows:
// its ring's blocks (slot r is row r), then its chunk's own keys in the call's kv
// projection (rows from `chunk`), then its compressed entries' blocks (from `entries`).
struct KeyLayout {
  int64_t per_block, chunk, entries;
  KeyLayout(const DeviceLayerState& st, int64_t n)
      : per_block(st.ring.rows_per_block()),
        chunk(static_cast<int64_t>(st.ring.blocks().size()) * per_block),
        entries(chunk + (n + per_block - 1) / per_block * per_block) {}
};

// Key lists per row of the call (window rows, then HCA entries or room for the
// indexer's picks), as rows of the row's own part's table.
struct KeyLists {
  std::vector<int32_t> index, offsets{0};
  std::vector<int32_t> visible, picks_at;  // CSA: per row
  std::vector<int64_t> max_visible;        // CSA: per part
  std::vector<int> longest;                // per part: keys of its longest list
};

KeyLists key_lists(const Step& s, const GpuModel::Layer& L, int layer, std::span<const Part> parts) {
  const int64_t sw = s.c.sliding_window;
  KeyLists k;
  for (const Part& part : parts) {
    const KeyLayout at(part.sequence->layers[layer], part.count);
    int longest = 0;
    int64_t max_visible = 0;
    for (int64_t t = 0; t < part.count; ++t) {
      const int64_t p = part.start + t;
      for (int64_t j = std::max<int64_t>(0, p - sw + 1); j <= p; ++j) {
        k.index.push_back(static_cast<int32_t>(j >= part.start ? at.chunk + (j - part.start) : j % sw));
      }
      if (L.compressor) {
        const int64_t visible = (p + 1) / L.compressor->ratio;
        if (!L.index_compressor) {
          for (int64_t w = 0; w < visible; ++w) k.index.push_back(static_cast<int32_t>(at.entries + w));
        } else {
          k.visible.push_back(static_cast<int32_t>(visible));
          k.picks_at.push_back(static_cast<int32_t>(k.index.size()));
          max_visible = std::max(max_visible, visible);
          k.index.resize(k.index.size() + std::min<int64_t>(visible, s.c.index_topk), -1);
        }
      }
      k.offsets.push_back(static_cast<int32_t>(k.index.size()));
      longest = std::max(longest, k.offsets.back() - k.offsets[k.offsets.size() - 2]);
    }
    k.longest.push_back(longest);
    k.max_visible.push_back(max_visible);
  }
  return k;
}

// The block pointers of `rows`, appended.
void add_blocks(const DevicePagedRows& rows, std::vector<const float*>& out) {
  for (size_t b = 0; b < rows.blocks().size(); ++b) out.push_back(rows.block_data(b));
}

// Stages every part's table (built by `table_of`) and, per row of the call, the address
// of its part's table; returns the device array of the latter.
template <typename TableOf>
const float* const* const* stage_tables(Staging& stage, std::span<const Part> parts, TableOf&& table_of) {
  std::vector<const float*> all;
  std::vector<size_t> starts;
  for (const Part& part : parts) {
    starts.push_back(all.size());
    table_of(part, all);
  }
  const float* const* tables = stage.stage(std::span<const float* const>(all));
  std::vector<const float* const*> rows;
  for (size_t i = 0; i < parts.size(); ++i) rows.insert(rows.end(), parts[i].count, tables + starts[i]);
  return stage.stage(std::span<const float* const* const>(rows));
}

// A layer's attention runs in three parts, so that a decode step can replay the first and
// the last as CUDA graphs (DecodeGraphs below): the projections and the output
// projections depend on the row count only; the core between them (compressor state, key
// lists, indexer, attend) depends on every sequence's state and runs launch by launch.

// What the projections leave in the workspace for the core: the rows of q and kv (normed
// and roped), and the compressors' and the indexer's inputs (null without them).
struct Projected {
  float *q, *kv;
  const float *ckv = nullptr, *cgate = nullptr, *ikv = nullptr, *igate = nullptr, *index_q = nullptr,
              *index_w = nullptr;
};

Projected projected(GpuModel::Workspace& ws, const GpuModel::Layer& L) {
  Projected p{ws.q.data(), ws.kv.data()};
  if (L.compressor) p.ckv = ws.proj_kv.data(), p.cgate = ws.proj_gate.data();
  if (L.index_compressor) {
    p.ikv = ws.index_kv.data(), p.igate = ws.index_gate.data();
    p.index_q = ws.index_q.data(), p.index_w = ws.index_w.data();
  }
  return p;
}

// A layer's attention projections, into the buffers projected() names: those of x (the
// compressors' and the indexer's too), then those of the normed q latent.
struct AttentionProjections {
  std::vector<Step::Projection> of_x, of_qr;
};

AttentionProjections attention_projections_of(GpuModel::Workspace& ws, const GpuModel::Layer& L) {
  AttentionProjections p{{{&L.wq_a, &ws.qr}, {&L.wkv, &ws.kv}}, {{&L.wq_b, &ws.q}}};
  if (L.compressor) {
    p.of_x.insert(p.of_x.end(), {{&L.compressor->wkv, &ws.proj_kv}, {&L.compressor->wgate, &ws.proj_gate}});
  }
  if (L.index_compressor) {
    p.of_x.insert(p.of_x.end(), {{&L.index_compressor->wkv, &ws.index_kv},
                                 {&L.index_compressor->wgate, &ws.index_gate},
                                 {&L.index_weights, &ws.index_w}});
    p.of_qr.push_back({&L.index_wq_b, &ws.index_q});
  }
  return p;
}

// Every buffer both sides of a layer's attention core use (the projections' outputs,
// and o, written by the core and read by the output projections), at its size for the
// call: a plan's staged copies and tables point into them, so they must not move
// between the plan and the launches.
void reserve_attention(const Step& s, const AttentionProjections& p) {
  for (const std::vector<Step::Projection>* list : {&p.of_x, &p.of_qr}) {
    for (const Step::Projection& q : *list) grow(*q.out, s.count * q.w->w.out);
  }
  grow(s.ws.o, s.count * s.c.num_attention_heads * s.c.head_dim);
}

// Every row's projections at once (into the buffers projected() names).
void attention_projections(const Step& s, const GpuModel::Layer& L, const float* x) {
  const ModelConfig& c = s.c;
  const int64_t S = s.count, H = c.num_attention_heads, hd = c.head_dim;
  GpuModel::Workspace& ws = s.ws;
  const int64_t* positions = ws.positions.data();

  // Every projection of x at once, then those of the normed q latent.
  s.mark("attention: projections, norms, rope");
  const AttentionProjections projections = attention_projections_of(ws, L);
  reserve_attention(s, projections);
  s.project_all(projections.of_x, x);
  float* qr = ws.qr.data();
  s.k.norm(qr, L.q_norm.data(), s.eps(), qr, S, c.q_lora_rank, s.stream);
  s.project_all(projections.of_qr, qr);
  // Each q head's unweighted norm and kv's norm, each with its rotation, in one launch.
  const NormRopePiece heads_and_kv[] = {{ws.q.data(), static_cast<int>(H), nullptr}, {ws.kv.data(), 1, L.kv_norm.data()}};
  norm_rope(s.rope, heads_and_kv, S, static_cast<int>(hd), s.eps(), positions, s.stream);
  if (L.index_compressor) {
    cuda::rope(s.rope, ws.index_q.data(), S, c.index_n_heads, c.index_head_dim, positions, false, s.stream);
    scale(ws.index_w.data(), S * c.index_n_heads, 1.0f / std::sqrt(static_cast<float>(c.index_n_heads)), s.stream);
  }
}

// What a layer's attention core launches with (attention_core): made on the host and
// staged by plan_attention, on the device after the stage's next flush.
struct AttentionPlan {
  std::span<const Part> parts;
  StagedCopies ring, after;  // the ring's new keys beside the core; the copies after it
  CompressorWork compressors;
  int32_t* key_index = nullptr;  // CSA: the indexer's picks go into each row's list
  const int32_t* key_offsets = nullptr;
  PagedTables key_tables{};
  std::vector<int> longest;  // per part: keys of its longest list
  int64_t max_visible = 0;
  int64_t group = 1;  // rows an attention launch takes (reserve_core)
  struct {
    PagedTables tables{};
    const int32_t *visible = nullptr, *picks_at = nullptr, *bases = nullptr;
  } index;
  int64_t live() const { return parts.back().row + parts.back().count; }  // rows with a part
};

// A planned core's scratch, grown when the core is planned so that its launches (a
// decode step's graph capture among them) never allocate: the indexer's scores, and the
// attention's split-key partial sums with their counters for groups of rows whose
// scratch stays within kAttentionScratch. Returns the rows of a group.
int64_t reserve_core(const Step& s, const GpuModel::Layer& L, const AttentionPlan& p) {
  const int64_t H = s.c.num_attention_heads, hd = s.c.head_dim, live = p.live();
  GpuModel::Workspace& ws = s.ws;
  if (L.index_compressor) grow(ws.index_scores, std::max<int64_t>(1, live * p.max_visible));
  const int most_keys = std::ranges::max(p.longest);
  const int64_t per_row = std::max<int64_t>(1, attend_decode_scratch(1, static_cast<int>(H), static_cast<int>(hd), most_keys));
  const int64_t group = std::clamp<int64_t>(kAttentionScratch / kF / per_row, 1, live);
  grow(ws.attention_scratch, group * per_row);
  grow_counters(ws.attention_arrivals, attend_decode_arrivals(static_cast<int>(group), static_cast<int>(H)), s.stream);
  return group;
}

// The host's side of a layer's attention core: each part's keys, compressor work,
// indexer inputs and copies, staged (nothing is launched). Rows past the parts' (a
// decode graph's padding) get row 0's output, so that they stay copies of row 0 (and
// route to its experts) through the layer.
AttentionPlan plan_attention(const Step& s, const GpuModel::Layer& L, int layer, std::span<const Part> parts) {
  const ModelConfig& c = s.c;
  const int64_t S = s.count, H = c.num_attention_heads, hd = c.head_dim, sw = c.sliding_window;
  GpuModel::Workspace& ws = s.ws;
  Staging& stage = ws.stage;
  reserve_attention(s, attention_projections_of(ws, L));
  AttentionPlan p;
  p.parts = parts;
  const Projected in = projected(ws, L);
  float* kv = in.kv;
  for (const Part& part : parts) {
    DeviceLayerState& st = part.sequence->layers[layer];
    if (st.ring.empty()) st.ring.resize(sw);
  }

  // A one-token part's key goes into its ring on the side stream, beside the rest of the
  // core: its slot (position p % sw) held position p - sw, which no list of this call
  // reads. A longer chunk's earlier rows read slots its later keys overwrite, so its keys
  // go in after the attention (at the end, on the stream).
  const auto ring_beside = [&](const Part& part) { return s.side && part.count == 1; };
  std::vector<CopyJob> jobs;
  for (const Part& part : parts) {
    if (!ring_beside(part)) continue;
    DeviceLayerState& st = part.sequence->layers[layer];
    jobs.push_back({st.ring.write_row(part.start % sw), kv + part.row * hd, hd});  // after any block copy it makes
  }
  p.ring = stage_copies(stage, jobs);

  // This chunk's compressor rows and entries into each sequence's state.
  std::vector<CompressorRows> compressor_rows;
  for (const Part& part : parts) {
    const auto rows_of = [&](const float* projection, const std::optional<DeviceCompressor>& w) {
      return w ? projection + part.row * w->width() : nullptr;
    };
    compressor_rows.push_back({&part.sequence->layers[layer], rows_of(in.ckv, L.compressor), rows_of(in.cgate, L.compressor),
                               rows_of(in.ikv, L.index_compressor), rows_of(in.igate, L.index_compressor), part.count});
  }
  p.compressors = plan_compressors(s, L, compressor_rows);

  // Every row's key list indexes its own part's block table: the kernels get a table per
  // row, so one launch covers all the sequences.
  KeyLists keys = key_lists(s, L, layer, parts);
  p.key_index = stage.stage(std::span<const int32_t>(keys.index));
  p.key_offsets = stage.stage(std::span<const int32_t>(keys.offsets));
  const int per_block = static_cast<int>(parts.front().sequence->layers[layer].ring.rows_per_block());
  p.key_tables = {stage_tables(stage, parts,
                               [&](const Part& part, std::vector<const float*>& table) {
                                 const DeviceLayerState& st = part.sequence->layers[layer];
                                 add_blocks(st.ring, table);
                                 for (int64_t r = 0; r < part.count; r += per_block) {
                                   table.push_back(kv + (part.row + r) * hd);
                                 }
                                 add_blocks(st.entries, table);
                               }),
                  per_block};
  for (const int64_t visible : keys.max_visible) p.max_visible = std::max(p.max_visible, visible);
  p.longest = std::move(keys.longest);
  if (L.index_compressor) {
    std::vector<int32_t> bases;
    for (const Part& part : parts) {
      bases.insert(bases.end(), part.count, static_cast<int32_t>(KeyLayout(part.sequence->layers[layer], part.count).entries));
    }
    p.index.tables = {stage_tables(stage, parts,
                                   [&](const Part& part, std::vector<const float*>& table) {
                                     add_blocks(part.sequence->layers[layer].index_keys, table);
                                   }),
                      static_cast<int>(parts.front().sequence->layers[layer].index_keys.rows_per_block())};
    p.index.visible = stage.stage(std::span<const int32_t>(keys.visible));
    p.index.picks_at = stage.stage(std::span<const int32_t>(keys.picks_at));
    p.index.bases = stage.stage(std::span<const int32_t>(bases));
  }
  for (const Part& part : parts) {  // after the attention, the ring keeps the newest keys
    if (ring_beside(part)) continue;
    DeviceLayerState& st = part.sequence->layers[layer];
    const int64_t end = part.start + part.count;
    for (int64_t q = std::max(part.start, end - sw); q < end; ++q) {
      jobs.push_back({st.ring.write_row(q % sw), kv + (part.row + q - part.start) * hd, hd});
    }
  }
  float* o = ws.o.data();
  for (int64_t r = p.live(); r < S; ++r) jobs.push_back({o + r * H * hd, o, H * hd});
  p.after = stage_copies(stage, jobs);
  p.group = reserve_core(s, L, p);
  return p;
}

// What was staged so far to the device: on the side stream where there is one (beside
// whatever the stream still runs), which the stream then waits for.
void flush_staged(const Step& s) {
  if (!s.side) return s.ws.stage.flush(s.stream);
  s.ws.stage.flush(s.side->stream);
  s.side->rejoin(s.stream);
}

// A planned attention core's launches, after its flush: the parts' keys, compressors,
// indexer and attention, each row on its own sequence's state, into ws.o. With a side
// stream, the copies no launch of the core reads (the ring's new keys and the rows that
// join open compressor windows; a state's rows either join its open window or are
// gathered by its closing ones, never both in one call) run there, after the
// projections; the stream waits for them at the next flush_staged.
void attend_planned(const Step& s, const GpuModel::Layer& L, int layer, const AttentionPlan& p) {
  const ModelConfig& c = s.c;
  const int64_t H = c.num_attention_heads, hd = c.head_dim, live = p.live();
  const std::span<const Part> parts = p.parts;
  GpuModel::Workspace& ws = s.ws;
  const Projected in = projected(ws, L);  // where the plan's copies and tables point (reserve_attention)
  const cudaStream_t beside = s.side ? s.side->stream : s.stream;
  if (s.side) s.side->start(s.stream);
  p.ring.run(beside);
  p.compressors.rows_in.run(beside);
  s.mark("attention: compressor windows");
  if (s.journal) {  // one sequence's verification: its compressor inputs, for a rewind's replay
    auto& saved = s.journal->layers.at(static_cast<size_t>(layer));
    const auto keep = [&](DeviceBuffer<float>& to, const float* from, int64_t width) {
      if (from) copy_into(to, from, live * width, s.stream);
    };
    if (L.compressor) keep(saved[0], in.ckv, L.compressor->width()), keep(saved[1], in.cgate, L.compressor->width());
    if (L.index_compressor) {
      keep(saved[2], in.ikv, L.index_compressor->width()), keep(saved[3], in.igate, L.index_compressor->width());
    }
  }
  p.compressors.windows.run(s);
  p.compressors.index_windows.run(s);
  s.mark("attention: key lists, indexer top-k");
  // The scratch was grown when the core was planned (reserve_core).
  if (L.index_compressor) {
    s.k.index(in.index_q, in.index_w, live, c.index_n_heads, c.index_head_dim, nullptr, p.index.visible,
              p.max_visible, c.index_topk, 0, p.index.picks_at, p.key_index, ws.index_scores.data(), p.index.tables,
              p.index.bases, s.stream);
  }
  s.mark("attention: attend");
  const int64_t group = p.group;
  const SplitScratch scratch{ws.attention_scratch.data(), ws.attention_arrivals.data()};
  // A part's rows go through its own kind's kernel, so a row's bits never depend on the
  // other parts of the call: one-token parts (decode) through the decode kernel, longer
  // chunks through the prefill kernel, and a verification's drafts (a call with a
  // journal) through the verify kernel. Consecutive parts of a kind share launches.
  const auto kernel_of = [&](const Part& part) {
    const auto kernel = part.count == 1 ? s.k.attend_decode : s.journal ? s.k.attend_verify : s.k.attend_prefill;
    if (!kernel) fail(ErrorCode::kernel_plan, {}, "no GPU attention kernel was planned for this kind of chunk");
    return kernel;
  };
  float* o = ws.o.data();
  for (size_t first = 0, end = 0; first < parts.size(); first = end) {
    const auto attend = kernel_of(parts[first]);
    int run_longest = 0;
    for (end = first; end < parts.size() && kernel_of(parts[end]) == attend; ++end) {
      run_longest = std::max(run_longest, p.longest[end]);
    }
    const int64_t run_end = parts[end - 1].row + parts[end - 1].count;
    for (int64_t r = parts[first].row; r < run_end; r += group) {
      const int64_t n = std::min(group, run_end - r);
      attend(in.q + r * H * hd, static_cast<int>(n), static_cast<int>(H), static_cast<int>(hd), nullptr, p.key_index,
             p.key_offsets + r, L.sinks.data(), 1.0f / std::sqrt(static_cast<float>(hd)), o + r * H * hd, scratch,
             run_longest, PagedTables{p.key_tables.tables + r, p.key_tables.rows_per_block}, s.stream);
    }
  }
  p.after.run(s.stream);
}

// A layer's whole attention core (after its projections), its copies joined at the end.
void attention_core(const Step& s, const GpuModel::Layer& L, int layer, std::span<const Part> parts) {
  const AttentionPlan plan = plan_attention(s, L, layer, parts);
  flush_staged(s);
  attend_planned(s, L, layer, plan);
  if (s.side) s.side->rejoin(s.stream);
}

// Every row's inverse rope on ws.o, then the grouped output projection (wo_a): wo_b's
// input.
const float* attention_output(const Step& s, const GpuModel::Layer& L) {
  const ModelConfig& c = s.c;
  const int64_t S = s.count, H = c.num_attention_heads, hd = c.head_dim;
  GpuModel::Workspace& ws = s.ws;
  float* o = ws.o.data();
  s.mark("attention: output projections");
  cuda::rope(s.rope, o, S, static_cast<int>(H), static_cast<int>(hd), ws.positions.data(), /*inverse=*/true, s.stream);
  // Grouped output projection: group g's heads through rows [g·r, (g+1)·r) of wo_a.
  const int64_t G = c.o_groups, r = c.o_lora_rank, group_in = H * hd / G;
  float* u = grow(ws.u, S * G * r);
  auto* planned = s.k.gemm[static_cast<size_t>(L.wo_a.planned)];
  if (planned == &cuda::linear || planned == &cuda::linear_mma) {
    // The planned kernel's pair form, one launch: pair t·G + g is row t·G + g of o seen
    // as [S·G, group_in] through group g's rows (ws.group_ids, uploaded with the call's
    // inputs: settled, so that one token's wo_a asks for its weights while the inverse
    // rope runs), into row t·G + g of u seen as [S·G, r].
    ws.pair_scratch.resize(static_cast<size_t>(linear_pairs_scratch(S * G, static_cast<int>(G))));
    const auto pairs_form = planned == &cuda::linear ? &linear_pairs : &linear_pairs_mma;
    pairs_form(L.wo_a_groups.data(), static_cast<int>(G), L.wo_a_group0, ws.group_ids.data(), S * G, 1, o, u,
               ws.pair_scratch.data(), s.stream, ExpertIds::settled);
  } else {
    float* gin = grow(ws.group_in, S * group_in);
    float* gout = grow(ws.group_out, S * r);
    for (int64_t g = 0; g < G; ++g) {
      check_api(cudaMemcpy2DAsync(gin, group_in * kF, o + g * group_in, H * hd * kF, group_in * kF, S,
                                  cudaMemcpyDeviceToDevice, s.stream),
                "cudaMemcpy2DAsync");
      s.linear(DeviceLinear{weight_rows(L.wo_a.w, g * r, r), L.wo_a.planned}, gin, gout, S);
      check_api(cudaMemcpy2DAsync(u + g * r, G * r * kF, gout, r * kF, r * kF, S, cudaMemcpyDeviceToDevice,
                                  s.stream),
                "cudaMemcpy2DAsync");
    }
  }
  return u;
}

// --- MoE (§6) --------------------------------------------------------------------------------

// h = clamped_swiglu(gate(x), up(x)) into each piece's gate ([rows, I]), its up as
// scratch: the layer's routed pairs and shared expert in one launch.
void swiglu_limit(const Step& s, std::span<const SwigluPiece> pieces) {
  clamped_swiglu(pieces, static_cast<float>(s.c.swiglu_limit), s.stream);
}

// The MoE's output before its weighted sum: a row per (token, routed expert) pair, the
// pairs' weights, and the input of the shared expert's down projection (null on ranks
// that do not run it): moe_out projects it, on the way into the streams where it can.
struct MoeOutput {
  const float *pairs, *weights, *shared_h;
  const float* shared_y = nullptr;  // the shared expert's output, where it ran beside the routed experts
};

// The most rows for which the shared expert runs beside the routed experts (moe): decode
// buckets and verify rows, not prefill.
constexpr int64_t kSharedBesideMaxRows = 64;

// Routing, then every (token, routed expert) pair through its expert with the expert
// ids read on the device (no host round trip), and the shared expert.
MoeOutput moe(const Step& s, const GpuModel::Layer& L, const float* x) {
  const ModelConfig& c = s.c;
  GpuModel::Workspace& ws = s.ws;
  const int64_t S = s.count, E = c.n_routed_experts, k = c.num_experts_per_tok, D = c.hidden_size;
  // The router's scores and the shared expert's gate and up projections, all of x, at once.
  s.mark("moe: router, shared expert's gate and up");
  const bool shared_here = s.share.rank == 0;  // the shared expert, once across the ranks
  // In a decode-sized call the products are too short to fill the GPU alone: the shared
  // expert (w1/w3, SwiGLU, w2) runs on the side stream beside the gate, routing and
  // routed experts (docs/perf.md, 2026-12-03). Prefill's long products fill it already.
  const bool beside = shared_here && s.side && S <= kSharedBesideMaxRows;
  std::vector<Step::Projection> of_x{{&L.gate, &ws.scores}};
  if (shared_here && !beside) of_x.insert(of_x.end(), {{&L.shared.w1, &ws.shared_g}, {&L.shared.w3, &ws.shared_up}});
  float* shared_y = nullptr;
  if (beside) {
    s.side->start(s.stream);
    Step side = s;
    side.stream = s.side->stream;
    const Step::Projection gate_up[] = {{&L.shared.w1, &ws.shared_g}, {&L.shared.w3, &ws.shared_up}};
    side.project_all(gate_up, x);
    const SwigluPiece h[] = {{ws.shared_g.data(), ws.shared_up.data(), S * L.shared.w1.w.out}};
    swiglu_limit(side, h);
    shared_y = grow(ws.shared_out, S * c.hidden_size);
    side.linear(L.shared.w2, ws.shared_g.data(), shared_y, S);
  }
  s.project_all(of_x, x);
  float* scores = ws.scores.data();
  // A hash layer's experts, looked up on the host with the call's inputs.
  const int32_t* hashed = L.hash_slot >= 0 ? ws.hashed.data() + L.hash_slot * S * k : nullptr;
  const int64_t pairs = S * k;
  ws.route_experts.resize(pairs);
  float* weights = grow(ws.route_weights, pairs);
  s.k.routing(scores, S, static_cast<int>(E), c.scoring_func, L.bias.size() ? L.bias.data() : nullptr, hashed,
              static_cast<int>(k), static_cast<float>(c.routed_scaling_factor), ws.route_experts.data(), weights,
              s.stream);

  s.mark("moe: routed experts");
  float* y = grow(ws.expert_out, pairs * D);
  std::vector<SwigluPiece> swiglus;  // the shared expert's gate and up are ready
  if (shared_here && !beside) swiglus.push_back({ws.shared_g.data(), ws.shared_up.data(), S * L.shared.w1.w.out});
  if (L.holds_any) {
    const int64_t I = L.like.w1.w.out;
    float* g = grow(ws.g, pairs * I);
    float* up = grow(ws.up, pairs * I);
    ws.pair_scratch.resize(static_cast<size_t>(linear_pairs_scratch(pairs, static_cast<int>(L.w1s.size()))));
    const auto pairs_through = [&](const DeviceBuffer<DeviceWeight>& table, const DeviceLinear& like, int per_row,
                                   const float* in, float* result, cuda::ExpertIds ids) {
      auto* kernel = s.k.experts[static_cast<size_t>(like.planned)];
      if (!kernel) fail(ErrorCode::kernel_plan, {}, "no GPU kernel was planned for the routed experts' format");
      kernel(table.data(), static_cast<int>(table.size()), like.w, ws.route_experts.data(), pairs, per_row, in, result,
             ws.pair_scratch.data(), s.stream, ids);
    };
    const DeviceWeight &w1 = L.like.w1.w, &w3 = L.like.w3.w;
    const bool alike = L.like.w1.planned == L.like.w3.planned && w1.format == w3.format && w1.dtype == w3.dtype &&
                       w1.out == w3.out && w1.in == w3.in && w1.f32_scales == w3.f32_scales;
    if (alike && s.k.experts[static_cast<size_t>(L.like.w1.planned)] == &linear_pairs_mma) {
      // The tensor-core pair form takes an expert's gate and up projections in one launch.
      linear_pairs_mma_two(L.w1s.data(), L.w3s.data(), static_cast<int>(L.w1s.size()), w1,
                           ws.route_experts.data(), pairs, static_cast<int>(k), x, g, up, ws.pair_scratch.data(),
                           s.stream);
    } else {
      pairs_through(L.w1s, L.like.w1, static_cast<int>(k), x, g, ExpertIds::just_written);
      pairs_through(L.w3s, L.like.w3, static_cast<int>(k), x, up, ExpertIds::just_written);
    }
    swiglus.push_back({g, up, pairs * I});
    swiglu_limit(s, swiglus);
    // The routing is two kernels back (the gate and up projections, then the SwiGLU):
    // one token's w2 asks for its experts' weights while the SwiGLU runs.
    pairs_through(L.w2s, L.like.w2, 1, g, y, ExpertIds::settled);
  } else {
    check_api(cudaMemsetAsync(y, 0, pairs * D * kF, s.stream), "cudaMemsetAsync");
    swiglu_limit(s, swiglus);
  }
  if (beside) s.side->rejoin(s.stream);
  return {y, weights, shared_here && !beside ? ws.shared_g.data() : nullptr, shared_y};
}

// --- One decoder layer (§3.1) -------------------------------------------------------------

// An mHC site's mix, collapse and norm: the sublayer's input x (ws.x); pre, post and comb
// stay in the workspace for hyper_out.
const float* hyper_in(const Step& s, const HyperParams& hp, const DeviceSite& site, const DeviceBuffer<float>& norm) {
  GpuModel::Workspace& ws = s.ws;
  const int64_t S = s.count, D = s.c.hidden_size;
  const SiteMix out{grow(ws.pre, S * hp.hc), grow(ws.post, S * hp.hc), grow(ws.comb, S * hp.hc * hp.hc),
                    grow(ws.x, S * D)};
  float* scratch = grow(ws.mix_scratch, std::max<int64_t>(1, hyper_in_scratch(hp, S)));
  unsigned* arrivals = grow_counters(ws.mix_arrivals, S, s.stream);
  s.mark("mhc: mix, collapse, norm");
  s.k.mix(hp, {site.fn.data(), site.base.data(), site.scale.data(), norm.data()}, ws.streams.data(), S, out, scratch,
          arrivals, s.stream);
  return out.x;
}

// The site's expand of the sublayer's output y back into the streams.
void hyper_out(const Step& s, const HyperParams& hp, const float* y) {
  GpuModel::Workspace& ws = s.ws;
  s.mark("mhc: expand");
  hyper_expand(hp, ws.post.data(), ws.comb.data(), y, ws.streams.data(), s.count, s.stream);
}

// The site's expand of a product y = x · Wᵀ (with `output`, of the MoE's output, y the
// shared expert's part): in the product's launch where the plan put W on the tensor-core
// GEMM and it takes x (linear_mma_expand: the same bits, no y written, one launch less),
// for calls of up to kExpandedRows rows (decode steps). Past them the expand kernel's pass
// is faster than the products' stores doing it (512-token prefill: 4.6% slower fused).
constexpr int64_t kExpandedRows = 8;

bool product_expanded(const Step& s, const HyperParams& hp, const DeviceLinear& w, const float* x,
                      const MoeOutput* output = nullptr) {
  if (s.count > kExpandedRows || s.k.gemm[static_cast<size_t>(w.planned)] != &cuda::linear_mma ||
      !linear_mma_takes(w.w, x)) {
    return false;
  }
  GpuModel::Workspace& ws = s.ws;
  HyperExpandInto into{ws.post.data(), ws.comb.data(), ws.streams.data(), hp.hc};
  if (output) into.pairs = output->pairs, into.weights = output->weights, into.k = s.c.num_experts_per_tok;
  linear_mma_expand(w.w, x, s.count, into, s.stream);
  return true;
}

// The MoE site's expand: on one rank with the pairs' weighted sum formed inside it (and
// the shared expert's down projection's, when the plan allows, inside that); across
// ranks, each rank's partial sum all-reduced first.
void moe_out(const Step& s, const HyperParams& hp, const GpuModel::Layer& L, const MoeOutput& m) {
  GpuModel::Workspace& ws = s.ws;
  const int k = s.c.num_experts_per_tok;
  const bool one_rank = s.share.ranks() == 1;
  s.mark("moe: shared expert's down");
  if (one_rank && m.shared_h && product_expanded(s, hp, L.shared.w2, m.shared_h, &m)) return;
  const float* shared = m.shared_y;
  if (m.shared_h) {
    float* ys = grow(ws.shared_out, s.count * s.c.hidden_size);
    s.linear(L.shared.w2, m.shared_h, ys, s.count);
    shared = ys;
  }
  if (one_rank) {
    s.mark("mhc: expand the moe's pairs");
    hyper_expand_pairs(hp, ws.post.data(), ws.comb.data(), m.pairs, m.weights, k, shared, ws.streams.data(), s.count,
                       s.stream);
    return;
  }
  s.mark("moe: combine, all-reduce");
  const int64_t rows = s.count * s.c.hidden_size;
  float* y = grow(ws.y, rows);
  combine_pairs(m.pairs, m.weights, s.count, k, s.c.hidden_size, shared, y, s.stream);
  s.share.all_reduce(y, rows, s.stream);
  hyper_out(s, hp, y);
}

// A layer before its attention core (the attention site's mix and the projections), and
// after it (the output projections and expand, then the whole MoE site): what a decode
// graph captures. Both depend on the call's row count and inputs only.
void layer_in(const Step& s, const HyperParams& hp, const GpuModel::Layer& L) {
  attention_projections(s, L, hyper_in(s, hp, L.hc_attn, L.attn_norm));
}

void layer_out(const Step& s, const HyperParams& hp, const GpuModel::Layer& L) {
  const float* u = attention_output(s, L);
  if (!product_expanded(s, hp, L.wo_b, u)) {
    float* y = grow(s.ws.y, s.count * s.c.hidden_size);
    s.linear(L.wo_b, u, y, s.count);
    hyper_out(s, hp, y);
  }
  moe_out(s, hp, L, moe(s, L, hyper_in(s, hp, L.hc_ffn, L.ffn_norm)));
}

// One decoder layer over the call's streams (ws.streams); `layer` indexes the sequences'
// states (the MTP block's is after the trunk's).
void run_layer(const Step& s, const HyperParams& hp, const GpuModel::Layer& L, int layer, std::span<const Part> parts) {
  layer_in(s, hp, L);
  attention_core(s, L, layer, parts);
  layer_out(s, hp, L);
}

DeviceLinear upload_linear(const Weight* w, std::vector<DeviceWeight>& owned, uint64_t& bytes) {
  DeviceLinear l{upload(*w), w->spec->format};
  owned.push_back(l.w);
  bytes += l.w.bytes;
  return l;
}

}  // namespace

uint64_t DeviceSequence::state_bytes() const {
  uint64_t bytes = 0;
  const auto compressor = [](const DeviceCompressorState& c) {
    return c.pending_kv.bytes() + c.pending_gate.bytes() + c.previous_kv.bytes() + c.previous_gate.bytes();
  };
  for (const DeviceLayerState& l : layers) {
    bytes += l.ring.bytes() + l.entries.bytes() + l.index_keys.bytes() + compressor(l.compressor) +
             compressor(l.indexer);
  }
  return bytes;
}

std::unique_ptr<GpuModel> GpuModel::create(const Model& model, int device, const BackendChoices& target,
                                           const BackendChoices& draft, ExpertShare share) {
  const std::vector<DeviceInfo> gpus = devices();
  if (device < 0 || device >= static_cast<int>(gpus.size())) {
    fail(ErrorCode::usage, {}, "no CUDA device " + std::to_string(device) + " (" + std::to_string(gpus.size()) +
                                   " found)");
  }
  const std::optional<Arch> arch = arch_of_capability(gpus[device].major, gpus[device].minor);
  if (!arch) {
    fail(ErrorCode::usage, {}, gpus[device].name + " (compute capability " + std::to_string(gpus[device].major) + "." +
                                   std::to_string(gpus[device].minor) + ") is not a GPU keel has kernels for");
  }
  std::unique_ptr<GpuModel> m(new GpuModel(model));
  const ModelConfig& c = model.config();
  m->plan_ = resolve_plan({.config = c, .arch = *arch, .target = target, .draft = draft});
  m->device_ = device;
  if (share.ranks() < 1 || share.rank < 0 || share.rank >= share.ranks() || (share.ranks() > 1 && !share.all_reduce)) {
    fail(ErrorCode::usage, {}, "an expert share needs 0 <= rank < ranks and, with several ranks, an all-reduce");
  }
  m->share_ = std::move(share);
  check_api(cudaSetDevice(device), "cudaSetDevice");
  check_api(cudaStreamCreate(&m->stream_), "cudaStreamCreate");
  m->pool_ = std::make_shared<DeviceBlockPool>(device, model.state_block_floats(), m->stream_);
  m->top_kernels_ = std::make_unique<Kernels>(bind_layer(m->plan_, -1));
  for (int l = 0; l < c.num_hidden_layers; ++l) m->layer_kernels_.push_back(bind_layer(m->plan_, l));
  m->has_draft_ = !model.tensors().mtp.empty();
  if (m->has_draft_) {
    m->layer_kernels_.push_back(bind_layer(m->plan_, c.num_hidden_layers, ModelRole::draft));
    m->draft_top_kernels_ = std::make_unique<Kernels>(bind_layer(m->plan_, -1, ModelRole::draft));
    m->draft_top_kernels_->check(*arch);
  }
  m->top_kernels_->check(*arch);
  for (const Kernels& k : m->layer_kernels_) k.check(*arch);
  m->work_ = std::make_unique<Workspace>();
  m->call_ = m->work_.get();
  m->graphs_ = std::make_unique<DecodeGraphs>();
  m->side_ = std::make_unique<SideStream>();

  const ModelTensors& t = model.tensors();
  auto& owned = m->owned_;
  auto& bytes = m->weight_bytes_;
  const auto linear = [&](const Weight* w) { return upload_linear(w, owned, bytes); };
  const auto site = [](DeviceSite& d, const HyperSite& h) {
    upload_floats(d.fn, h.fn);
    upload_floats(d.base, h.base);
    upload_floats(d.scale, h.scale);
  };
  const auto compressor = [&](const CompressorWeights& w) {
    DeviceCompressor d{linear(w.wkv), linear(w.wgate)};
    upload_floats(d.ape, w.ape);
    upload_floats(d.norm, w.norm);
    d.ratio = w.ratio;
    d.dim = w.dim;
    d.overlapping = w.overlapping;
    return d;
  };
  const auto expert = [&](const ExpertWeights& e) { return DeviceExpert{linear(e.w1), linear(e.w2), linear(e.w3)}; };
  m->embed_ = upload(*t.embed);
  m->head_ = upload(*t.head);
  owned.push_back(m->embed_);
  owned.push_back(m->head_);
  bytes += m->embed_.bytes + m->head_.bytes;
  upload_floats(m->norm_, t.norm);
  upload_floats(m->head_fn_, t.hc_head.fn);
  upload_floats(m->head_base_, t.hc_head.base);
  upload_floats(m->head_scale_, t.hc_head.scale);
  int hash_layers = 0;
  const auto upload_layer = [&](const LayerWeights& w) {
    Layer& d = m->layers_.emplace_back();
    d.kind = w.attn.kind;
    site(d.hc_attn, w.hc_attn);
    site(d.hc_ffn, w.hc_ffn);
    upload_floats(d.attn_norm, w.attn_norm);
    upload_floats(d.ffn_norm, w.ffn_norm);
    upload_floats(d.q_norm, w.attn.q_norm);
    upload_floats(d.kv_norm, w.attn.kv_norm);
    upload_floats(d.sinks, w.attn.sinks);
    d.wq_a = linear(w.attn.wq_a);
    d.wq_b = linear(w.attn.wq_b);
    d.wkv = linear(w.attn.wkv);
    d.wo_a = linear(w.attn.wo_a);
    std::vector<DeviceWeight> groups;
    for (int64_t g = 0; g < c.o_groups; ++g) groups.push_back(weight_rows(d.wo_a.w, g * c.o_lora_rank, c.o_lora_rank));
    d.wo_a_groups.assign(std::span<const DeviceWeight>(groups));
    d.wo_a_group0 = groups.front();
    d.wo_b = linear(w.attn.wo_b);
    if (w.attn.compressor) d.compressor = compressor(*w.attn.compressor);
    if (w.attn.indexer) {
      d.index_compressor = compressor(w.attn.indexer->compressor);
      d.index_wq_b = linear(w.attn.indexer->wq_b);
      d.index_weights = linear(w.attn.indexer->weights_proj);
    }
    d.gate = linear(w.ffn.gate);
    upload_floats(d.bias, w.ffn.bias);
    if (w.ffn.kind == MlpKind::hash_moe) {
      d.tid2eid = &w.ffn.tid2eid;
      d.hash_slot = hash_layers++;
    }
    std::vector<DeviceWeight> w1s, w2s, w3s;
    for (size_t e = 0; e < w.ffn.experts.size(); ++e) {
      DeviceExpert held{};
      if (m->share_.holds(static_cast<int64_t>(e))) {
        held = expert(w.ffn.experts[e]);
        if (!d.holds_any) d.like = held;
        d.holds_any = true;
      }
      w1s.push_back(held.w1.w);
      w2s.push_back(held.w2.w);
      w3s.push_back(held.w3.w);
    }
    d.w1s.assign(std::span<const DeviceWeight>(w1s));
    d.w2s.assign(std::span<const DeviceWeight>(w2s));
    d.w3s.assign(std::span<const DeviceWeight>(w3s));
    d.shared = expert(w.ffn.shared);
  };
  for (const LayerWeights& w : t.layers) upload_layer(w);
  if (m->has_draft_) {  // the MTP block after the trunk's layers, and its own weights
    const MtpWeights& w = t.mtp.front();
    upload_layer(w.block);
    m->mtp_ = std::make_unique<Mtp>();
    m->mtp_->e_proj = linear(w.e_proj);
    m->mtp_->h_proj = linear(w.h_proj);
    upload_floats(m->mtp_->enorm, w.enorm);
    upload_floats(m->mtp_->hnorm, w.hnorm);
    upload_floats(m->mtp_->norm, w.norm);
    upload_floats(m->mtp_->hc_fn, w.hc_head.fn);
    upload_floats(m->mtp_->hc_base, w.hc_head.base);
    upload_floats(m->mtp_->hc_scale, w.hc_head.scale);
  }
  std::vector<int32_t> tid2eid;  // in hash-slot order, as the layers were numbered
  for (const Layer& L : m->layers_) {
    if (L.tid2eid) tid2eid.insert(tid2eid.end(), L.tid2eid->begin(), L.tid2eid->end());
  }
  m->hash_layers_ = hash_layers;
  m->tid2eid_.assign(std::span<const int32_t>(tid2eid));
  m->rope_main_ = upload(Rope(c.rope_main));
  m->rope_compress_ = upload(Rope(c.rope_compress));
  check_api(cudaDeviceSynchronize(), "weights upload");
  return m;
}

GpuModel::GpuModel(const Model& host) : host_(host) {}

GpuModel::~GpuModel() {
  cudaSetDevice(device_);
  graphs_.reset();  // its graphs and buffers, before the stream
  side_.reset();
  for (DeviceWeight& w : owned_) release(w);
  release(rope_main_);
  release(rope_compress_);
  if (stream_) cudaStreamDestroy(stream_);
}

DeviceSequence GpuModel::clone(const DeviceSequence& sequence) const { return sequence; }

namespace {

// Blocks a compressor may take for `n` more tokens: its new entries (in `entries`), its
// open window and (CSA, when a window closes) previous series at ratio rows, and a copy
// of every shared block it writes.
int64_t compressor_blocks(const DeviceCompressor& w, const DeviceCompressorState& st, const DevicePagedRows& entries,
                          int64_t n) {
  int64_t blocks = entries.blocks_to_grow(st.count + (st.pending + n) / w.ratio, false);
  blocks += st.pending_kv.blocks_to_grow(w.ratio, true) + st.pending_gate.blocks_to_grow(w.ratio, true);
  if (w.overlapping && st.pending + n >= w.ratio) {
    blocks += st.previous_kv.blocks_to_grow(w.ratio, true) + st.previous_gate.blocks_to_grow(w.ratio, true);
  }
  return blocks;
}

}  // namespace

int64_t GpuModel::blocks_needed(const DeviceSequence& seq, int64_t n) const {
  const ModelConfig& c = config();
  int64_t blocks = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = layers_[l];
    const DeviceLayerState& st = seq.layers[l];
    blocks += st.ring.blocks_to_grow(c.sliding_window, true);
    if (L.compressor) blocks += compressor_blocks(*L.compressor, st.compressor, st.entries, n);
    if (L.index_compressor) blocks += compressor_blocks(*L.index_compressor, st.indexer, st.index_keys, n);
  }
  return blocks;
}

DeviceSequence GpuModel::new_sequence() const {
  const ModelConfig& c = config();
  const auto compressor = [&](const std::optional<DeviceCompressor>& w) {
    DeviceCompressorState st;
    if (!w) return st;
    for (DevicePagedRows* r : {&st.pending_kv, &st.pending_gate, &st.previous_kv, &st.previous_gate}) {
      *r = DevicePagedRows(pool_, w->width());
    }
    return st;
  };
  DeviceSequence s;
  for (int l = 0; l < c.num_hidden_layers + (has_draft_ ? 1 : 0); ++l) {
    const Layer& L = layers_[l];
    DeviceLayerState& st = s.layers.emplace_back();
    st.ring = DevicePagedRows(pool_, c.head_dim);
    if (L.compressor) st.entries = DevicePagedRows(pool_, c.head_dim);
    if (L.index_compressor) st.index_keys = DevicePagedRows(pool_, c.index_head_dim);
    st.compressor = compressor(L.compressor);
    st.indexer = compressor(L.index_compressor);
  }
  return s;
}

std::vector<float> GpuModel::forward(DeviceSequence& sequence, std::span<const int32_t> tokens,
                                     LogitRows rows) const {
  const DeviceChunk chunk{&sequence, tokens};
  return std::move(forward(std::span(&chunk, 1), rows).front());
}

// --- Decode steps as CUDA graphs ----------------------------------------------------------

// Decode steps as CUDA graphs, a few a step: a step of one token per sequence runs its
// rows padded to a bucket, in pieces: the embedding and the first layer's input side,
// then the layers in pieces of 1, 2, 4, 8, ... layers, each layer's attention core in
// its piece (step_piece_layers). A piece's cores are planned first (their key lists, block
// tables and closing windows staged, then flushed once), so its launches depend on
// nothing the host does between them; they are captured each step, since the cores'
// lists and grids follow the sequences' state, and the executable graph of the same
// bucket, piece and shape is updated to them (cudaGraphExecUpdate) and launched. A
// piece's shape (its node and edge count) changes where compressor windows close; a
// bucket's piece keeps an executable graph per shape. The first pieces are small, so
// that the device starts soon after the host does, and later ones larger, so that few
// boundaries between graphs remain, while the host captures ahead of the device. A step
// begun while the device still runs the call before (pipelined: the host is a call
// ahead) runs as one piece, the embedding and every layer: its start waits on the call
// before anyway, and each boundary between graphs costs the device a gap.
// Padded rows are copies of row 0 (its token, position and attention output), so they
// read no other experts, and every kernel computes a row alone, so no real row changes:
// a step gives the same bits from graphs as launched.
//
// The graphs read the buffers of a workspace of their own, which only these steps use.
// Its buffers grow with the bucket, and the cores' scratch with the context, only while
// a piece is planned, never while one is captured. A bucket larger than any run before
// runs launch by launch first (growing them to fit it and every smaller bucket) and
// drops the graphs made before, which point at the old buffers.
struct GpuModel::DecodeGraphs {
  static constexpr std::array<int64_t, 15> kBuckets{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256};
  static constexpr size_t kShapesPerPiece = 8;  // past it, the oldest shape's graph goes
  struct Shape {
    size_t nodes = 0, edges = 0;
    cudaGraphExec_t exec = nullptr;
  };
  Workspace work;
  std::map<std::tuple<int64_t, bool, int>, std::vector<Shape>> by_piece;  // (bucket, ahead, piece): most recent last
  int64_t sized_for = 0;  // the largest bucket run: every buffer fits it
  DecodeGraphCounts counts;  // counts.on: whether decode steps take graphs

  DecodeGraphs() = default;
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;
  ~DecodeGraphs() { clear(); }
  void clear() {
    for (auto& [piece, shapes] : by_piece) {
      for (const Shape& shape : shapes) cudaGraphExecDestroy(shape.exec);
    }
    by_piece.clear();
  }
  // The bucket a step of `rows` rows pads to; 0 for more rows than the largest.
  static int64_t bucket_of(int64_t rows) {
    for (const int64_t b : kBuckets) {
      if (rows <= b) return b;
    }
    return 0;
  }
};

namespace {

// Layers in piece p (from 1) of a decode step the device waits for: 1, 2, 4, 8, ...
int step_piece_layers(int piece) { return 1 << std::min(piece - 1, 20); }

// One decode step's pieces, each launched as it comes (no graphs, or the first step of a
// new largest bucket), or captured, the executable graph of its bucket, piece and shape
// updated to it (or made), and launched. A capture that fails (a CUDA call the capture
// refuses) turns graphs off for the model, with the reason in its counts, and the piece
// runs launch by launch: a graph never fails a step that would run without.
class StepPieces {
 public:
  StepPieces(GpuModel::DecodeGraphs* graphs, int64_t bucket, bool ahead, cudaStream_t stream)
      : graphs_(graphs), bucket_(bucket), ahead_(ahead), stream_(stream) {
    if (!graphs_) return;
    if (bucket_ > graphs_->sized_for) {
      graphs_->clear();
      graphs_->sized_for = bucket_;
    } else {
      capture_ = true;
    }
  }

  template <typename Launches>
  void run(int piece, Launches&& launches) {
    if (!capture_ || !graphs_->counts.on) return launches();
    cudaError_t status = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    if (status != cudaSuccess) return give_up(cudaGetErrorString(status), launches);
    cudaGraph_t graph = nullptr;
    std::string failure;
    try {
      launches();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    status = cudaStreamEndCapture(stream_, &graph);
    if (failure.empty() && status != cudaSuccess) failure = cudaGetErrorString(status);
    cudaGraphExec_t exec = nullptr;
    if (failure.empty()) {
      status = executable(piece, graph, exec);
      if (status != cudaSuccess) failure = cudaGetErrorString(status);
    }
    if (graph) cudaGraphDestroy(graph);
    if (!failure.empty()) return give_up(failure, launches);
    check_api(cudaGraphLaunch(exec, stream_), "cudaGraphLaunch");
  }
  // Every piece ran as a graph: the step counts as replayed where none was made anew.
  void finish() {
    if (capture_ && graphs_->counts.on && !made_) ++graphs_->counts.replayed;
  }

 private:
  // The executable graph of the piece with `graph`'s shape, updated to it; or one made now.
  cudaError_t executable(int piece, cudaGraph_t graph, cudaGraphExec_t& exec) {
    GpuModel::DecodeGraphs::Shape shape;
    cudaError_t status = cudaGraphGetNodes(graph, nullptr, &shape.nodes);
    if (status == cudaSuccess) status = cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &shape.edges);
    if (status != cudaSuccess) return status;
    std::vector<GpuModel::DecodeGraphs::Shape>& shapes = graphs_->by_piece[{bucket_, ahead_, piece}];
    const auto same = std::find_if(shapes.begin(), shapes.end(), [&](const auto& s) {
      return s.nodes == shape.nodes && s.edges == shape.edges;
    });
    if (same != shapes.end()) {
      cudaGraphExecUpdateResultInfo result{};
      if (cudaGraphExecUpdate(same->exec, graph, &result) == cudaSuccess) {
        exec = same->exec;
        return cudaSuccess;
      }
      cudaGetLastError();  // not updatable after all: made anew below
      cudaGraphExecDestroy(same->exec);
      shapes.erase(same);
    }
    status = cudaGraphInstantiate(&shape.exec, graph, 0);
    if (status != cudaSuccess) return status;
    if (shapes.size() == GpuModel::DecodeGraphs::kShapesPerPiece) {
      cudaGraphExecDestroy(shapes.front().exec);
      shapes.erase(shapes.begin());
    }
    shapes.push_back(shape);
    exec = shape.exec;
    if (!made_) ++graphs_->counts.captured;  // a step counts once
    made_ = true;
    return cudaSuccess;
  }
  // Graphs off for the model, with the reason; nothing captured ran, so the piece runs
  // launch by launch (and the step's later pieces too).
  template <typename Launches>
  void give_up(const std::string& failure, Launches& launches) {
    cudaGetLastError();
    graphs_->counts.on = false;
    graphs_->counts.failure = failure;
    graphs_->clear();
    launches();
  }

  GpuModel::DecodeGraphs* graphs_;
  int64_t bucket_;
  bool ahead_;
  cudaStream_t stream_;
  bool capture_ = false, made_ = false;
};

// The call's host-made inputs, uploaded before any launch (the pieces only read them):
// each row's token and position, each hash layer's experts for each row (tid2eid looked
// up here, [hash layers, rows, k]), the output projection's group of each pair, and for
// the rows whose token the device picks (sources >= 0), where it picks them from.
void upload_inputs(const ModelConfig& c, std::span<const GpuModel::Layer> layers, GpuModel::Workspace& ws,
                   std::span<const int32_t> tokens, std::span<const int64_t> positions,
                   std::span<const int32_t> sources, cudaStream_t stream) {
  const int64_t S = static_cast<int64_t>(tokens.size()), k = c.num_experts_per_tok, G = c.o_groups;
  std::vector<CopyJob> jobs;  // into buffers whose addresses decode graphs keep
  add_upload(jobs, ws.stage, ws.tokens, tokens);
  add_upload(jobs, ws.stage, ws.positions, positions);
  const auto hash_layers = std::count_if(layers.begin(), layers.end(), [](const auto& L) { return L.tid2eid; });
  std::vector<int32_t> hashed(hash_layers * S * k);
  for (const GpuModel::Layer& L : layers) {
    if (!L.tid2eid) continue;
    for (int64_t t = 0; t < S; ++t) std::copy_n(&(*L.tid2eid)[tokens[t] * k], k, &hashed[(L.hash_slot * S + t) * k]);
  }
  add_upload(jobs, ws.stage, ws.hashed, std::span<const int32_t>(hashed));
  std::vector<int32_t> groups(S * G);
  for (int64_t p = 0; p < S * G; ++p) groups[p] = static_cast<int32_t>(p % G);
  add_upload(jobs, ws.stage, ws.group_ids, std::span<const int32_t>(groups));
  if (!sources.empty()) add_upload(jobs, ws.stage, ws.pick_sources, sources);
  copy_now(ws.stage, jobs, stream);
}

}  // namespace

namespace {

// Where a call's sampling summaries are: on the device, where the next call's picks read
// them, and in the copy back on the host (the same layout: totals, ids, values).
struct SummaryRows {
  const RowTotals* totals = nullptr;
  const int32_t* ids = nullptr;
  int stride = 1;
  const uint8_t* host = nullptr;  // null: the rows were not summarized on the device
  size_t totals_bytes = 0, list_bytes = 0;
};

using EventHandle = std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)>;

EventHandle record_event(cudaStream_t stream) {
  cudaEvent_t e = nullptr;
  check_api(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  EventHandle handle(e, &cudaEventDestroy);
  check_api(cudaEventRecord(e, stream), "cudaEventRecord");
  return handle;
}

}  // namespace

// A call begun (GpuModel::begin) and not yet finished.
struct GpuModel::Begun {
  std::vector<size_t> chosen;      // the chunks with a choice, in summary-row order
  std::vector<RowChoice> choices;  // theirs
  std::vector<int32_t> sources;    // each chunk's pick_source for the next call; -1: none there
  bool draws_on_host = false;      // a row draws among candidates (PickKind::candidates)
  SummaryRows rows;
  Workspace* ws = nullptr;
  EventHandle done{nullptr, &cudaEventDestroy};  // passed once the summaries are back
  std::optional<std::vector<std::optional<RowSummary>>> results;  // once collected
};

namespace {

const int32_t kPickedPlaceholder[1] = {0};  // a picked row's token until the device writes it

// The pick_source a chunk's one token comes from in the call before (-1: its own tokens).
int32_t pick_source_of(const DeviceChunk& chunk, const GpuModel::Begun* before) {
  if (chunk.pick_of < 0) return -1;
  if (!chunk.tokens.empty()) fail(ErrorCode::usage, {}, "a chunk that takes its token from the call before has tokens too");
  if (!before) fail(ErrorCode::usage, {}, "a chunk takes its token from the call before, but no call is begun");
  const auto from = static_cast<size_t>(chunk.pick_of);
  if (from >= before->sources.size() || before->sources[from] < 0) {
    fail(ErrorCode::usage, {},
         fmt::format("chunk {} of the call before has no token the device picks (no choice, or a draw among "
                     "candidates, which the host makes)",
                     chunk.pick_of));
  }
  return before->sources[from];
}

// The summaries of the workspace's first choices.size() rows of logits by the device's
// sampling kernel, and their copy back (not waited for).
SummaryRows enqueue_summaries(decltype(&cuda::summarize_rows) sample, GpuModel::Workspace& ws,
                              std::span<const RowChoice> choices, int64_t V, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(choices.size());
  if (ws.timer) ws.timer->mark("sampling summaries", stream);
  std::vector<SummaryTask> tasks;
  int stride = 1;
  for (const RowChoice& choice : choices) {
    tasks.push_back(summary_task(choice));
    tasks.back().candidates = std::min(tasks.back().candidates, kMaxCandidates);
    stride = std::max(stride, tasks.back().candidates);
  }
  const SummaryTask* staged_tasks = ws.stage.stage(std::span<const SummaryTask>(tasks));
  ws.stage.flush(stream);
  // Totals, ids and values in one buffer: one copy back. The kernels' scratch after them.
  SummaryRows r{.stride = stride, .totals_bytes = n * sizeof(RowTotals), .list_bytes = n * stride * sizeof(int32_t)};
  const size_t bytes = r.totals_bytes + 2 * r.list_bytes, scratch_at = (bytes + 15) / 16 * 16;
  ws.sample_out.resize(scratch_at + cuda::summary_scratch_bytes(n, V));
  uint8_t* out_device = ws.sample_out.data();
  r.totals = reinterpret_cast<const RowTotals*>(out_device);
  r.ids = reinterpret_cast<const int32_t*>(out_device + r.totals_bytes);
  sample(ws.logits.data(), n, V, staged_tasks, stride, reinterpret_cast<RowTotals*>(out_device),
         reinterpret_cast<int32_t*>(out_device + r.totals_bytes),
         reinterpret_cast<float*>(out_device + r.totals_bytes + r.list_bytes), out_device + scratch_at, stream);
  uint8_t* host = ws.sample_host.grow(bytes);
  check_api(cudaMemcpyAsync(host, out_device, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  r.host = host;
  return r;
}

// The summaries enqueue_summaries copied back (after they have arrived); a row whose
// summary does not suffice is summarized again from its logits, still in the workspace.
std::vector<RowSummary> read_summaries(const SummaryRows& r, std::span<const RowChoice> choices,
                                       GpuModel::Workspace& ws, int64_t V) {
  const auto* totals = reinterpret_cast<const RowTotals*>(r.host);
  const auto* ids = reinterpret_cast<const int32_t*>(r.host + r.totals_bytes);
  const auto* values = reinterpret_cast<const float*>(r.host + r.totals_bytes + r.list_bytes);
  std::vector<RowSummary> out;
  std::vector<float> row;
  for (size_t j = 0; j < choices.size(); ++j) {
    RowSummary s = row_summary(totals[j], ids + j * r.stride, values + j * r.stride, V);
    if (!summary_suffices(choices[j].params, s)) {  // rare: a top-p mass beyond the candidates
      row.resize(static_cast<size_t>(V));
      check_api(cudaMemcpy(row.data(), ws.logits.data() + j * V, V * kF, cudaMemcpyDeviceToHost), "cudaMemcpy");
      s = summarize_for(row, choices[j]);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

int64_t GpuModel::run(std::span<const DeviceChunk> batch, std::span<const int64_t> head_rows,
                      DeviceJournal* journal) const {
  const ModelConfig& c = config();
  // Every chunk is checked before any state changes: a bad one fails the call alone.
  std::vector<Part> parts;
  std::vector<int32_t> tokens, sources;  // sources: each row's pick_source in the call before, or -1
  std::vector<int64_t> positions;
  const Begun* before = begun_.empty() ? nullptr : &begun_.back();
  for (size_t i = 0; i < batch.size(); ++i) {
    const DeviceChunk& chunk = batch[i];
    if (!chunk.sequence) fail(ErrorCode::usage, {}, "a batched forward chunk has no sequence");
    for (const Part& p : parts) {
      if (p.sequence == chunk.sequence) fail(ErrorCode::usage, {}, "a sequence appears twice in one batched forward");
    }
    const int32_t source = pick_source_of(chunk, before);
    const std::span<const int32_t> chunk_tokens = source >= 0 ? std::span<const int32_t>(kPickedPlaceholder) : chunk.tokens;
    check_tokens(c, chunk.sequence->length, chunk_tokens);
    const int64_t n = static_cast<int64_t>(chunk_tokens.size());
    if (head_rows[i] < 0 || head_rows[i] > n) fail(ErrorCode::usage, {}, "a chunk's logit rows are not among its tokens");
    parts.push_back({chunk.sequence, chunk.sequence->length, static_cast<int64_t>(tokens.size()), n});
    tokens.insert(tokens.end(), chunk_tokens.begin(), chunk_tokens.end());
    sources.insert(sources.end(), static_cast<size_t>(n), source);
    for (int64_t t = 0; t < n; ++t) positions.push_back(chunk.sequence->length + t);
  }
  if (parts.empty()) return 0;
  const bool picks = std::any_of(sources.begin(), sources.end(), [](int32_t r) { return r >= 0; });
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  const Kernels& top = *top_kernels_;
  top.check(plan_.arch);
  for (int l = 0; l < c.num_hidden_layers; ++l) layer_kernels_[l].check(plan_.arch);

  // A decode step (one token per sequence) replays the bucket's graphs where it can; its
  // padded rows are copies of row 0.
  const bool decode_step = !journal && std::all_of(parts.begin(), parts.end(), [](const Part& p) { return p.count == 1; });
  const bool graphs_apply = decode_step && graphs_->counts.on && share_.ranks() == 1 && !work_->timer;
  const int64_t bucket = graphs_apply ? DecodeGraphs::bucket_of(static_cast<int64_t>(tokens.size())) : 0;
  DecodeGraphs* graphs = bucket ? graphs_.get() : nullptr;
  if (graphs) {
    tokens.resize(static_cast<size_t>(bucket), tokens.front());
    sources.resize(static_cast<size_t>(bucket), sources.front());
    positions.resize(static_cast<size_t>(bucket), positions.front());
  }
  Workspace& ws = graphs ? graphs->work : *work_;
  call_ = &ws;
  const int64_t S = static_cast<int64_t>(tokens.size()), D = c.hidden_size, V = c.vocab_size;
  const HyperParams hp = hyper_params(c);

  // The staging and summary memory the call before this one used may still be read
  // (a pipelined call); the call before that one has finished. So the first flush (on the
  // side stream, into this call's staging) need not wait for the call before.
  ws.turn();
  upload_inputs(c, layers_, ws, tokens, positions, picks ? std::span<const int32_t>(sources) : std::span<const int32_t>{},
                stream_);
  if (picks) {  // the tokens (and hash layers' experts) the call before chose, on the device
    const SummaryRows& from = before->rows;
    take_picks(from.totals, from.ids, from.stride, ws.pick_sources.data(), S, c.vocab_size,
               tid2eid_.data(), hash_layers_, c.num_experts_per_tok, ws.tokens.data(), ws.hashed.data(), stream_);
  }
  grow(ws.streams, S * hp.hc * D);
  const auto step = [&](int l) {
    const DeviceRope& rope = c.attention[l] == AttentionKind::sliding ? rope_main_ : rope_compress_;
    return Step{c, share_, layer_kernels_[l], rope, ws, stream_, S, journal, side_.get()};
  };
  const int layers = c.num_hidden_layers;
  const auto embed = [&] {
    if (ws.timer) ws.timer->mark("embedding", stream_);
    top.embedding(embed_, ws.tokens.data(), S, hp.hc, ws.streams.data(), stream_);
    if (layers > 0) layer_in(step(0), hp, layers_[0]);
  };
  const auto layer_after_core = [&](int l) {  // its output side, then the next layer's input side
    layer_out(step(l), hp, layers_[l]);
    if (l + 1 < layers) layer_in(step(l + 1), hp, layers_[l + 1]);
  };
  if (decode_step) {
    // In pieces (DecodeGraphs): each piece's cores planned and flushed before its launches.
    // Plans stage copies that point into the workspace, so what every plan of a piece uses
    // is grown before the first is made.
    for (int l = 0; l < layers; ++l) reserve_attention(step(l), attention_projections_of(ws, layers_[l]));
    // The device still runs the call before (begun, not collected): the embedding goes
    // into the one piece.
    const bool ahead = before && !before->results && layers > 0;
    StepPieces pieces(graphs, bucket, ahead, stream_);
    if (!ahead) pieces.run(0, embed);
    for (int first = 0, piece = 1; first < layers; ++piece) {
      const int end = ahead ? layers : std::min(layers, first + step_piece_layers(piece));
      for (int l = first; l < end; ++l) reserve_closing(step(l), layers_[l], l, parts);
      std::vector<AttentionPlan> plans;
      for (int l = first; l < end; ++l) plans.push_back(plan_attention(step(l), layers_[l], l, parts));
      flush_staged(step(first));
      pieces.run(piece, [&] {
        if (ahead && first == 0) embed();
        for (int l = first; l < end; ++l) {
          attend_planned(step(l), layers_[l], l, plans[static_cast<size_t>(l - first)]);
          if (side_) side_->rejoin(stream_);
          layer_after_core(l);
        }
      });
      first = end;
    }
    pieces.finish();
  } else {
    // Longer chunks: each layer's core planned while the layer before runs, so that the
    // staging holds one layer's key lists at a time (a long prompt's are large), and what
    // it reads flushed before the launches that lead to it: the stream then waits for the
    // side stream once (for that flush and for the core before's copies), not also before
    // the core; a wait there cost the core's first launch about 1.5 us (docs/perf.md,
    // 2026-12-04).
    std::optional<AttentionPlan> plan;
    if (layers > 0) plan = plan_attention(step(0), layers_[0], 0, parts);
    flush_staged(step(0));
    embed();
    for (int l = 0; l < layers; ++l) {
      attend_planned(step(l), layers_[l], l, *plan);
      if (l + 1 < layers) plan = plan_attention(step(l + 1), layers_[l + 1], l + 1, parts);
      flush_staged(step(l));
      layer_after_core(l);
    }
  }
  for (const Part& p : parts) p.sequence->length += p.count;

  // The rows that get logits: each chunk's last head_rows, gathered unless they are
  // every row (one copy launch for all chunks).
  if (ws.timer) ws.timer->mark("head: hc_head, norm, lm_head", stream_);
  const int64_t row_floats = hp.hc * D;
  std::vector<CopyJob> jobs;
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    if (head_rows[i] == 0) continue;
    jobs.push_back({nullptr, ws.streams.data() + (p.row + p.count - head_rows[i]) * row_floats, head_rows[i] * row_floats});
    n += head_rows[i];
  }
  if (n == 0) return 0;
  const float* head_streams = ws.streams.data();
  if (n != S) {
    float* gathered = grow(ws.head_streams, n * row_floats);
    for (CopyJob& j : jobs) {
      j.dst = gathered;
      gathered += j.count;
    }
    copy_now(ws.stage, jobs, stream_);
    head_streams = ws.head_streams.data();
  }
  float* h = grow(ws.head_in, n * D);
  float* head_scratch = grow(ws.head_scratch, hyper_head_scratch(hp, n));
  hyper_head(hp, head_fn_.data(), head_base_.data(), head_scale_.data(), head_streams, n, h, head_scratch, stream_);
  top.norm(h, norm_.data(), static_cast<float>(c.rms_norm_eps), h, n, D, stream_);
  grow(ws.logits, n * V);
  top.gemm[static_cast<size_t>(host_.tensors().head->spec->format)](head_, h, ws.logits.data(), n, stream_);
  return n;
}

void GpuModel::end_call() const {
  Workspace& ws = *call_;
  if (!ws.timer) {
    check_api(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return;
  }
  // Besides the stages, the host's side: enqueueing the call, then waiting for the
  // device at its end (near zero when the host is what sets the pace).
  ws.timer->mark("end", stream_);
  const double enqueue = ws.timer->host_seconds();
  check_api(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  profile_["host: enqueue"] += enqueue;
  profile_["host: wait for the device"] += ws.timer->host_seconds() - enqueue;
  ws.timer->collect(profile_);
}

const float* GpuModel::copy_back_logits(int64_t rows) const {
  Workspace& ws = *call_;
  if (ws.timer) ws.timer->mark("logits copy back", stream_);
  // Through pinned memory: a pageable copy back runs at a fraction of the link's speed,
  // and a batch's logits are large (256 rows of a 129K vocabulary: 132 MB).
  const size_t floats = static_cast<size_t>(rows * config().vocab_size);
  float* host = ws.logits_host.grow(floats);
  check_api(cudaMemcpyAsync(host, ws.logits.data(), floats * kF, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
  end_call();
  return host;
}

std::vector<std::vector<float>> GpuModel::forward(std::span<const DeviceChunk> batch, LogitRows which) const {
  require_idle("a forward call");
  std::vector<int64_t> head_rows;
  for (const DeviceChunk& chunk : batch) {
    head_rows.push_back(which == LogitRows::last ? std::min<int64_t>(1, static_cast<int64_t>(chunk.tokens.size()))
                                                 : static_cast<int64_t>(chunk.tokens.size()));
  }
  const int64_t n = run(batch, head_rows);
  const int64_t V = config().vocab_size;
  const float* logits = n ? copy_back_logits(n) : nullptr;
  if (!n && !batch.empty()) end_call();
  std::vector<std::vector<float>> out;
  int64_t row = 0;
  for (const int64_t rows : head_rows) {
    out.emplace_back(logits + row * V, logits + (row + rows) * V);
    row += rows;
  }
  return out;
}

std::vector<std::optional<RowSummary>> GpuModel::forward(std::span<const DeviceChunk> batch,
                                                         std::span<const std::optional<RowChoice>> choices) const {
  require_idle("a forward call");
  begin(batch, choices);
  return finish();
}

bool GpuModel::picks(const SamplingParams& params) const {
  return top_kernels_->sample && pick_kind(params) != PickKind::candidates;
}

void GpuModel::require_idle(const char* what) const {
  if (!begun_.empty()) fail(ErrorCode::usage, {}, fmt::format("{} while a begun call is not finished", what));
}

void GpuModel::begin(std::span<const DeviceChunk> batch, std::span<const std::optional<RowChoice>> choices) const {
  if (choices.size() != batch.size()) fail(ErrorCode::usage, {}, "a batched forward needs one choice (or none) per chunk");
  if (begun_.size() >= 2) fail(ErrorCode::usage, {}, "two calls are begun and not finished: finish one first");
  // A call whose rows draw among candidates may need its logits again (a summary that
  // does not suffice), and this call overwrites them: it is finished first.
  if (!begun_.empty() && !begun_.back().results && begun_.back().draws_on_host) collect(begun_.back());
  Begun call;
  if (batch.empty()) {
    call.results.emplace();
    begun_.push_back(std::move(call));
    return;
  }
  call.sources.assign(batch.size(), -1);
  std::vector<int64_t> head_rows;
  for (size_t i = 0; i < batch.size(); ++i) {
    const bool tokens = !batch[i].tokens.empty() || batch[i].pick_of >= 0;
    head_rows.push_back(choices[i] && tokens ? 1 : 0);
    if (!head_rows.back()) continue;
    call.chosen.push_back(i);
    call.choices.push_back(*choices[i]);
  }
  const int64_t n = run(batch, head_rows);
  call.ws = call_;
  if (n > 0 && top_kernels_->sample) {  // summarized on the device, copied back at the end
    call.rows = enqueue_summaries(top_kernels_->sample, *call.ws, call.choices, config().vocab_size, stream_);
    for (size_t j = 0; j < call.chosen.size(); ++j) {
      const PickKind kind = pick_kind(call.choices[j].params);
      if (kind == PickKind::candidates) call.draws_on_host = true;
      else call.sources[call.chosen[j]] = pick_source(static_cast<int64_t>(j), kind);
    }
  }
  call.done = record_event(stream_);
  begun_.push_back(std::move(call));
  // The host sampler's rows come back whole; profiling times each call alone.
  if ((n > 0 && !top_kernels_->sample) || begun_.back().ws->timer) collect(begun_.back());
}

std::vector<std::optional<RowSummary>> GpuModel::finish() const {
  if (begun_.empty()) fail(ErrorCode::usage, {}, "finish: no call is begun");
  if (!begun_.front().results) collect(begun_.front());
  std::vector<std::optional<RowSummary>> out = std::move(*begun_.front().results);
  begun_.erase(begun_.begin());
  return out;
}

void GpuModel::collect(Begun& call) const {
  Workspace& ws = *call.ws;
  call_ = &ws;
  std::vector<RowSummary> rows;
  if (call.chosen.empty()) {
    end_call();
  } else if (!call.rows.host) {  // the plan chose the host sampler: every row comes back
    rows = summarize_logits(*top_kernels_, call.choices);
  } else {
    if (ws.timer) end_call();
    else check_api(cudaEventSynchronize(call.done.get()), "cudaEventSynchronize");
    rows = read_summaries(call.rows, call.choices, ws, config().vocab_size);
    for (size_t j = 0; j < rows.size(); ++j) {
      if (call.sources[call.chosen[j]] >= 0 && !summary_suffices(call.choices[j].params, rows[j])) {
        throw std::runtime_error("a pipelined step's device pick was not a token (its row's summary has none)");
      }
    }
  }
  call.results.emplace(call.sources.size());
  for (size_t j = 0; j < rows.size(); ++j) (*call.results)[call.chosen[j]] = std::move(rows[j]);
}

std::vector<RowSummary> GpuModel::summarize_logits(const Kernels& top, std::span<const RowChoice> choices) const {
  const int64_t n = static_cast<int64_t>(choices.size()), V = config().vocab_size;
  std::vector<RowSummary> out;
  if (!top.sample) {  // the plan chose the host sampler: every row comes back
    const float* logits = copy_back_logits(n);
    for (int64_t j = 0; j < n; ++j) out.push_back(summarize_for(std::span(logits + j * V, V), choices[j]));
    return out;
  }
  const SummaryRows rows = enqueue_summaries(top.sample, *call_, choices, V, stream_);
  end_call();
  return read_summaries(rows, choices, *call_, V);
}

// --- The MTP layer and speculative decoding ---------------------------------------------

RowSummary GpuModel::draft(DeviceSequence& seq, const float* streams, std::span<const int32_t> next_tokens,
                           const RowChoice& choice, DeviceBuffer<float>& out_streams) const {
  require_idle("a draft");
  if (!has_draft_) fail(ErrorCode::usage, {}, "this model has no MTP layer to draft with");
  const ModelConfig& c = config();
  check_tokens(c, seq.draft_length + 1, next_tokens);
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  const HyperParams hp = hyper_params(c);
  const int64_t S = static_cast<int64_t>(next_tokens.size()), D = c.hidden_size, V = c.vocab_size;
  const int layer = c.num_hidden_layers;
  const Kernels& k = layer_kernels_[layer];
  const Kernels& top = *draft_top_kernels_;
  k.check(plan_.arch);
  top.check(plan_.arch);
  Workspace& ws = *work_;
  call_ = &ws;
  const Mtp& m = *mtp_;
  std::vector<int64_t> positions(S);
  for (int64_t i = 0; i < S; ++i) positions[i] = seq.draft_length + i;
  ws.stage.reset();
  upload_inputs(c, layers_, ws, next_tokens, positions, {}, stream_);
  const Step s{c, share_, k, rope_main_, ws, stream_, S};
  // e = RMSNorm(embed[t]; enorm) · e_projᵀ; each stream RMSNorm(X; hnorm) · h_projᵀ + e.
  float* e = grow(ws.head_in, S * D);
  top.embedding(embed_, ws.tokens.data(), S, 1, e, stream_);
  k.norm(e, m.enorm.data(), s.eps(), e, S, D, stream_);
  float* ep = grow(ws.y, S * D);
  s.linear(m.e_proj, e, ep, S);
  float* normed = grow(ws.x, S * hp.hc * D);
  k.norm(streams, m.hnorm.data(), s.eps(), normed, S * hp.hc, D, stream_);
  float* y = grow(ws.streams, S * hp.hc * D);
  s.linear(m.h_proj, normed, y, S * hp.hc);
  add_to_groups(y, ep, S, hp.hc, D, stream_);
  const Part part{&seq, seq.draft_length, 0, S};
  run_layer(s, hp, layers_[layer], layer, std::span(&part, 1));
  seq.draft_length += S;
  // The last row: its streams for a further draft, its logits through the MTP's head.
  const float* last = ws.streams.data() + (S - 1) * hp.hc * D;
  copy_into(out_streams, last, hp.hc * D, stream_);
  float* h = grow(ws.head_in, D);
  float* scratch = grow(ws.head_scratch, hyper_head_scratch(hp, 1));
  hyper_head(hp, m.hc_fn.data(), m.hc_base.data(), m.hc_scale.data(), last, 1, h, scratch, stream_);
  k.norm(h, m.norm.data(), s.eps(), h, 1, D, stream_);
  grow(ws.logits, V);
  top.gemm[static_cast<size_t>(host_.tensors().head->spec->format)](head_, h, ws.logits.data(), 1, stream_);
  return std::move(summarize_logits(top, std::span(&choice, 1)).front());
}

std::vector<RowSummary> GpuModel::verify(DeviceSequence& seq, std::span<const int32_t> tokens,
                                         std::span<const RowChoice> choices, DeviceBuffer<float>& streams,
                                         DeviceJournal* journal) const {
  require_idle("a verification");
  const ModelConfig& c = config();
  const int64_t n = static_cast<int64_t>(tokens.size()), head_rows = static_cast<int64_t>(choices.size());
  if (head_rows < 1 || head_rows > n) fail(ErrorCode::usage, {}, "a verification summarizes 1 .. tokens rows");
  if (journal) {  // drafts attend through the verify kernel: planned only for a model with a draft
    const auto trunk = std::span(layer_kernels_).first(static_cast<size_t>(c.num_hidden_layers));
    if (std::any_of(trunk.begin(), trunk.end(), [](const Kernels& k) { return !k.attend_verify; })) {
      fail(ErrorCode::kernel_plan, {}, "verifying drafts needs the plan's attention_verify kernels (a model with an MTP layer)");
    }
    journal->layers.resize(static_cast<size_t>(c.num_hidden_layers));
  }
  const DeviceChunk chunk{&seq, tokens};
  run(std::span(&chunk, 1), std::span(&head_rows, 1), journal);
  copy_into(streams, call_->streams.data(), n * c.hc_mult * c.hidden_size, stream_);
  return summarize_logits(*top_kernels_, choices);
}

void GpuModel::mark_layers(const DeviceSequence& seq, size_t first, size_t count, int64_t length, int64_t ahead,
                           DeviceMark& mark) const {
  require_idle("a mark");
  const int64_t sw = config().sliding_window, hd = config().head_dim;
  if (ahead < 0 || ahead > sw) fail(ErrorCode::usage, {}, "a sequence mark covers 0 .. sliding_window tokens ahead");
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  mark.length = length;
  mark.ahead = ahead;
  mark.layers.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const DeviceLayerState& st = seq.layers[first + i];
    DeviceMark::Layer& ml = mark.layers[i];
    ml.ring_empty = st.ring.empty();
    float* ring = grow(ml.ring, ahead * hd);
    for (int64_t p = length; p < length + ahead && !ml.ring_empty; ++p) {
      check_api(cudaMemcpyAsync(ring + (p - length) * hd, st.ring.row(p % sw), hd * kF, cudaMemcpyDeviceToDevice,
                                stream_),
                "cudaMemcpyAsync");
    }
    ml.compressor = st.compressor;  // shares the blocks of the open window and previous series
    ml.indexer = st.indexer;
  }
}

void GpuModel::restore_layers(DeviceSequence& seq, size_t first, const DeviceMark& mark, int64_t keep) const {
  const int64_t sw = config().sliding_window, hd = config().head_dim;
  if (keep < 0 || keep > mark.ahead) fail(ErrorCode::usage, {}, "a sequence is rewound past the tokens of its mark");
  for (size_t i = 0; i < mark.layers.size(); ++i) {
    DeviceLayerState& st = seq.layers[first + i];
    const DeviceMark::Layer& ml = mark.layers[i];
    for (int64_t p = mark.length + keep; p < mark.length + mark.ahead && !ml.ring_empty; ++p) {
      check_api(cudaMemcpyAsync(st.ring.write_row(p % sw), ml.ring.data() + (p - mark.length) * hd, hd * kF,
                                cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync");
    }
    st.compressor = ml.compressor;
    st.indexer = ml.indexer;
    st.entries.resize(ml.compressor.count);
    st.index_keys.resize(ml.indexer.count);
  }
}

void GpuModel::mark(const DeviceSequence& seq, int64_t ahead, DeviceMark& mark) const {
  mark_layers(seq, 0, static_cast<size_t>(config().num_hidden_layers), seq.length, ahead, mark);
}

void GpuModel::rewind(DeviceSequence& seq, const DeviceMark& mark, const DeviceJournal& journal, int64_t keep) const {
  require_idle("a rewind");
  const ModelConfig& c = config();
  if (journal.layers.size() != static_cast<size_t>(c.num_hidden_layers)) {
    fail(ErrorCode::usage, {}, "a rewind needs the journal of the verification it undoes");
  }
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  work_->stage.reset();  // the last call ended synchronized
  restore_layers(seq, 0, mark, keep);
  // The kept tokens' compressor inputs join the restored compressors again: the same
  // windows close into the same entries.
  for (int l = 0; l < c.num_hidden_layers && keep > 0; ++l) {
    const Layer& L = layers_[l];
    if (!L.compressor && !L.index_compressor) continue;
    const DeviceRope& rope = c.attention[l] == AttentionKind::sliding ? rope_main_ : rope_compress_;
    const Step s{c, share_, layer_kernels_[l], rope, *work_, stream_, keep};
    DeviceLayerState& st = seq.layers[l];
    const auto& saved = journal.layers[l];
    const CompressorRows rows{&st, saved[0].data(), saved[1].data(), saved[2].data(), saved[3].data(), keep};
    const CompressorWork work = plan_compressors(s, L, std::span(&rows, 1));
    work_->stage.flush(stream_);
    work.run(s);
  }
  seq.length = mark.length + keep;
  check_api(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void GpuModel::mark_draft(const DeviceSequence& seq, int64_t ahead, DeviceMark& mark) const {
  mark_layers(seq, static_cast<size_t>(config().num_hidden_layers), 1, seq.draft_length, ahead, mark);
}

void GpuModel::rewind_draft(DeviceSequence& seq, const DeviceMark& mark) const {
  require_idle("a rewind");
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  restore_layers(seq, static_cast<size_t>(config().num_hidden_layers), mark, 0);
  seq.draft_length = mark.length;
  check_api(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void GpuModel::set_profiling(bool on) {
  require_idle("turning profiling on or off");
  work_->timer = on ? std::make_unique<StageTimer>() : nullptr;
  profile_.clear();
}

void GpuModel::set_decode_graphs(bool on) {
  require_idle("turning decode graphs on or off");
  check_api(cudaSetDevice(device_), "cudaSetDevice");
  graphs_->clear();
  graphs_->counts = {.on = on};
}

DecodeGraphCounts GpuModel::decode_graph_counts() const { return graphs_->counts; }

}  // namespace keel::cuda
