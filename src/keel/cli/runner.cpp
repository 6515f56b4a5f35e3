#include "cli/runner.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <fmt/format.h>

#include "base/error.h"
#if KEEL_HAVE_CUDA
#include "cuda/device.h"
#include "cuda/gpu_model.h"
#endif
#if KEEL_HAVE_NCCL
#include "parallel/expert_parallel.h"
#endif

namespace keel::cli {
namespace {

// Read bandwidth over a buffer far larger than the caches, all threads, best of 5.
double read_bandwidth(uint64_t bytes) {
  std::vector<uint64_t> buffer(bytes / sizeof(uint64_t));
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = i;  // first touch by the reading thread
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (size_t i = 0; i < buffer.size(); ++i) sum += buffer[i];
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (sum == 42) fmt::print("");  // keeps the loop
    best = std::max(best, bytes / s);
  }
  return best;
}

class CpuRunner final : public Runner {
 public:
  explicit CpuRunner(const Model& model) : model_(model), seq_(model.new_sequence()) {}
  void reset() override { seq_ = model_.new_sequence(); }
  std::vector<float> forward(std::span<const int32_t> tokens, LogitRows rows) override {
    return model_.forward(seq_, tokens, rows);
  }
  int64_t length() const override { return seq_.length; }
  const Plan& plan() const override { return model_.plan(); }
  std::string device() const override { return fmt::format("cpu ({} threads)", omp_get_max_threads()); }
  double measure_bandwidth(uint64_t bytes) const override { return read_bandwidth(bytes); }

 private:
  const Model& model_;
  Sequence seq_;
};

#if KEEL_HAVE_CUDA
class GpuRunner final : public Runner {
 public:
  GpuRunner(std::unique_ptr<cuda::GpuModel> model, int device, std::string name)
      : model_(std::move(model)), seq_(model_->new_sequence()), index_(device), name_(std::move(name)) {}
  void reset() override { seq_ = model_->new_sequence(); }
  std::vector<float> forward(std::span<const int32_t> tokens, LogitRows rows) override {
    return model_->forward(seq_, tokens, rows);
  }
  int64_t length() const override { return seq_.length; }
  const Plan& plan() const override { return model_->plan(); }
  std::string device() const override { return fmt::format("cuda:{} ({})", index_, name_); }
  double measure_bandwidth(uint64_t bytes) const override { return cuda::copy_bandwidth(index_, bytes, 10); }
  void set_profiling(bool on) override { model_->set_profiling(on); }
  std::map<std::string, double> profile() const override { return model_->profile(); }

 private:
  std::unique_ptr<cuda::GpuModel> model_;
  cuda::DeviceSequence seq_;
  int index_;
  std::string name_;
};
#endif

#if KEEL_HAVE_NCCL
class ParallelRunner final : public Runner {
 public:
  explicit ParallelRunner(std::unique_ptr<parallel::ExpertParallelModel> model)
      : model_(std::move(model)), seq_(model_->new_sequence()) {}
  void reset() override { seq_ = model_->new_sequence(); }
  std::vector<float> forward(std::span<const int32_t> tokens, LogitRows rows) override {
    return model_->forward(seq_, tokens, rows);
  }
  int64_t length() const override { return seq_.length(); }
  const Plan& plan() const override { return model_->plan(); }
  std::string device() const override {
    return fmt::format("{} GPUs, expert parallel ({})", model_->gpus(), cuda::devices().at(0).name);
  }
  double measure_bandwidth(uint64_t bytes) const override { return cuda::copy_bandwidth(0, bytes, 10); }
  void reset_communication() override { model_->reset_communication_time(); }
  double communication_seconds() const override { return model_->communication_seconds(); }
  double all_reduce_floor(int64_t floats) override { return model_->all_reduce_seconds(floats, 50); }
  void set_profiling(bool on) override { model_->rank(0).set_profiling(on); }
  std::map<std::string, double> profile() const override { return model_->rank(0).profile(); }

 private:
  std::unique_ptr<parallel::ExpertParallelModel> model_;
  parallel::ExpertParallelModel::Sequence seq_;
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

Loaded load_runner(const std::string& directory, bool quiet, const KernelOptions& options) {
  if (options.gpus > 1) {
#if KEEL_HAVE_NCCL
    Loaded l{load_model(directory, /*quiet=*/true, KernelOptions{})};
    const auto start = std::chrono::steady_clock::now();
    auto model = parallel::ExpertParallelModel::create(*l.model, options.gpus, options.target, options.draft);
    if (!quiet) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print(stderr, "uploaded {} to {} GPUs in {:.2f} s\n{}{}\n", directory, options.gpus, s, model->layout(),
                 model->plan().summary());
    }
    if (options.verbose) fmt::print(stderr, "{}", model->plan().table());
    l.runner = std::make_unique<ParallelRunner>(std::move(model));
    return l;
#else
    fail(ErrorCode::usage, {.field = "--gpus"}, "this keel was built without NCCL; several GPUs need it");
#endif
  }
  const std::optional<int> gpu = options.gpus == 1 ? std::optional<int>(0) : cuda_index(options.device);
  if (!gpu) {
    Loaded l{load_model(directory, quiet, options)};
    l.runner = std::make_unique<CpuRunner>(*l.model);
    return l;
  }
#if KEEL_HAVE_CUDA
  KernelOptions host;  // the host copy only feeds the upload: the CPU's own plan
  host.verbose = false;
  Loaded l{load_model(directory, /*quiet=*/true, host)};
  const auto start = std::chrono::steady_clock::now();
  auto model = cuda::GpuModel::create(*l.model, *gpu, options.target, options.draft);
  const std::string name = cuda::devices().at(*gpu).name;
  if (!quiet) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(stderr, "uploaded {} ({:.1f} MiB of weights) to cuda:{} ({}) in {:.2f} s\n{}\n", directory,
               model->weight_bytes() / 1048576.0, *gpu, name, s, model->plan().summary());
  }
  if (options.verbose) fmt::print(stderr, "{}", model->plan().table());
  l.runner = std::make_unique<GpuRunner>(std::move(model), *gpu, name);
  return l;
#else
  fail(ErrorCode::usage, {.field = "--device"}, "this keel was built without CUDA; use --device cpu");
#endif
}

}  // namespace keel::cli
