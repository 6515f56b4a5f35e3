#include "cli/runner.h"

#include <algorithm>
#include <chrono>
#include <fmt/format.h>

#include "base/error.h"
#include "plan/expert_split.h"
#if KEEL_HAVE_CUDA
#include "cuda/device.h"
#include "cuda/gpu_executor.h"
#include "cuda/gpu_model.h"
#endif
#if KEEL_HAVE_NCCL
#include "parallel/expert_parallel.h"
#include "parallel/parallel_speculative.h"
#endif

namespace keel::cli {
namespace {

#if KEEL_HAVE_NCCL
// Every rank holds the same state (attention is replicated), so a sequence's bytes are
// one device's: the state budget is per device.
struct ParallelSequence final : SequenceState {
  parallel::ExpertParallelModel::Sequence sequence;
  int64_t length() const override { return sequence.length(); }
  uint64_t bytes() const override { return sequence.ranks.empty() ? 0 : sequence.ranks.front().state_bytes(); }
};

class ParallelExecutor final : public Executor {
 public:
  explicit ParallelExecutor(std::unique_ptr<parallel::ExpertParallelModel> model) : model_(std::move(model)) {}
  std::unique_ptr<SequenceState> new_sequence() const override {
    auto s = std::make_unique<ParallelSequence>();
    s->sequence = model_->new_sequence();
    return s;
  }
  uint64_t state_in_use() const override {
    const cuda::GpuModel& rank0 = model_->rank(0);
    return cuda::pool_bytes(rank0, rank0.state_pool().used());
  }
  uint64_t state_growth(const SequenceState* sequence, int64_t tokens) const override {
    const cuda::GpuModel& rank0 = model_->rank(0);
    return cuda::pool_bytes(rank0, sequence ? rank0.blocks_needed(static_cast<const ParallelSequence*>(sequence)->sequence.ranks.front(), tokens)
                                      : rank0.blocks_needed(rank0.new_sequence(), tokens));
  }
  void limit_state(uint64_t bytes) const override {
    for (int r = 0; r < model_->gpus(); ++r) {
      model_->rank(r).state_pool().set_capacity(static_cast<int64_t>(cuda::pool_capacity(model_->rank(r), bytes)));
    }
  }
  std::unique_ptr<SequenceState> clone(const SequenceState& sequence) const override {
    auto s = std::make_unique<ParallelSequence>();
    const auto& from = static_cast<const ParallelSequence&>(sequence).sequence;
    for (int r = 0; r < model_->gpus(); ++r) s->sequence.ranks.push_back(model_->rank(r).clone(from.ranks[r]));
    return s;
  }
  std::vector<float> forward(SequenceState& sequence, std::span<const int32_t> tokens, LogitRows rows) const override {
    return model_->forward(static_cast<ParallelSequence&>(sequence).sequence, tokens, rows);
  }
  std::vector<std::vector<float>> forward_batch(std::span<const SequenceChunk> batch,
                                                LogitRows rows) const override {
    return model_->forward(rank_chunks(batch), rows);
  }
  std::vector<std::optional<RowSummary>> forward_choices(
      std::span<const SequenceChunk> batch, std::span<const std::optional<RowChoice>> choices) const override {
    return model_->forward(rank_chunks(batch), choices);
  }
  const Plan& plan() const override { return model_->plan(); }
  std::string device() const override {
    const Ranks& r = model_->ranks();
    const std::string hosts = r.hosts > 1 ? fmt::format(" on {} hosts (this one: host {})", r.hosts, r.host) : "";
    return fmt::format("{} GPUs{}, expert parallel ({})", r.world(), hosts, cuda::devices().at(0).name);
  }
  double measure_bandwidth(uint64_t bytes) const override { return cuda::copy_bandwidth(0, bytes, 10); }
  double measure_tensor_throughput() const override { return cuda::mma_bf16_throughput(0, 5); }
  std::optional<Memory> device_memory() const override {
    Memory least{~uint64_t{0}, 0};
    for (int r = 0; r < model_->gpus(); ++r) {
      const cuda::MemoryInfo m = cuda::memory_info(r);
      if (m.free < least.free) least = {m.free, m.total};
    }
    return least;
  }
  void reset_communication() override { model_->reset_communication_time(); }
  double communication_seconds() const override { return model_->communication_seconds(); }
  double all_reduce_floor(int64_t floats) override { return model_->all_reduce_seconds(floats, 50); }
  std::unique_ptr<SpeculativeTarget> speculative_target() const override {
    return std::make_unique<parallel::ParallelSpeculativeTarget>(*model_);
  }
  void set_profiling(bool on) override { model_->rank(0).set_profiling(on); }
  std::map<std::string, double> profile() const override { return model_->rank(0).profile(); }

 private:
  static std::vector<parallel::ExpertParallelModel::Chunk> rank_chunks(std::span<const SequenceChunk> batch) {
    std::vector<parallel::ExpertParallelModel::Chunk> chunks;
    for (const SequenceChunk& c : batch) {
      chunks.push_back({&static_cast<ParallelSequence*>(c.sequence)->sequence, c.tokens});
    }
    return chunks;
  }

  std::unique_ptr<parallel::ExpertParallelModel> model_;
};
#endif

// "cuda" -> 0, "cuda:3" -> 3; nullopt for "cpu".
std::optional<int> cuda_index(const std::string& device) {
  if (device == "cpu") return std::nullopt;
  if (device == "cuda") return 0;
  if (device.starts_with("cuda:") && device.size() > 5 &&
      std::all_of(device.begin() + 5, device.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return std::stoi(device.substr(5));
  }
  fail(ErrorCode::usage, {.field = "--device"}, "'" + device + "' is not cpu, cuda or cuda:N");
}

}  // namespace

Loaded load_executor(const std::string& directory, bool quiet, const KernelOptions& options) {
  if (options.gpus > 1 || options.hosts > 1) {
    const Ranks ranks{
        .gpus = std::max(1, options.gpus), .hosts = options.hosts, .host = options.host_rank, .id_file = options.nccl_id};
    ranks.check();
#if KEEL_HAVE_NCCL
    Loaded l{load_model(directory, /*quiet=*/true, KernelOptions{})};
    const auto start = std::chrono::steady_clock::now();
    auto model = parallel::ExpertParallelModel::create(*l.model, ranks, options.target, options.draft);
    if (!quiet) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print(stderr, "uploaded {} to {} GPUs in {:.2f} s\n{}{}\n", directory, ranks.gpus, s, model->layout(),
                 model->plan().summary());
    }
    if (options.verbose) fmt::print(stderr, "{}", model->plan().table());
    l.executor = std::make_unique<ParallelExecutor>(std::move(model));
    return l;
#else
    fail(ErrorCode::usage, {.field = "--gpus"}, "this keel was built without NCCL; several GPUs need it");
#endif
  }
  const std::optional<int> gpu = options.gpus == 1 ? std::optional<int>(0) : cuda_index(options.device);
  if (!gpu) {
    Loaded l{load_model(directory, quiet, options)};
    l.executor = std::make_unique<CpuExecutor>(*l.model);
    return l;
  }
#if KEEL_HAVE_CUDA
  // The host copy only feeds the upload: it keeps the CPU's own automatic plan.
  Loaded l{load_model(directory, /*quiet=*/true, KernelOptions{})};
  const auto start = std::chrono::steady_clock::now();
  auto model = cuda::GpuModel::create(*l.model, *gpu, options.target, options.draft);
  if (options.eager) model->set_decode_graphs(false);
  const std::string name = cuda::devices().at(*gpu).name;
  if (!quiet) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(stderr, "uploaded {} ({:.1f} MiB of weights) to cuda:{} ({}) in {:.2f} s\n{}\n", directory,
               model->weight_bytes() / 1048576.0, *gpu, name, s, model->plan().summary());
  }
  if (options.verbose) fmt::print(stderr, "{}", model->plan().table());
  l.executor = std::make_unique<cuda::GpuExecutor>(std::move(model), *gpu, name);
  return l;
#else
  fail(ErrorCode::usage, {.field = "--device"}, "this keel was built without CUDA; use --device cpu");
#endif
}

}  // namespace keel::cli
