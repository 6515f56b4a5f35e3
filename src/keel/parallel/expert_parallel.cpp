#include "parallel/expert_parallel.h"

#include <nccl.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "base/error.h"
#include "cuda/device.h"

namespace keel::parallel {
namespace {

void check_nccl(ncclResult_t status, const char* what) {
  if (status != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(status));
}

}  // namespace

// The communicators, and rank 0's timing of its all-reduces within one forward call.
struct ExpertParallelModel::Comms {
  std::vector<ncclComm_t> comms;
  std::vector<cudaEvent_t> marks;  // rank 0: start, stop of each all-reduce of the call
  size_t used = 0;

  ~Comms() {
    for (cudaEvent_t e : marks) cudaEventDestroy(e);
    for (ncclComm_t c : comms) ncclCommDestroy(c);
  }
  // `rank` counts this host's ranks; the first one's calls are timed.
  void all_reduce(int rank, float* data, int64_t count, cudaStream_t stream) {
    const bool timed = rank == 0;
    if (timed) mark(stream);
    check_nccl(ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat, ncclSum, comms[rank], stream),
               "ncclAllReduce");
    if (timed) mark(stream);
  }
  void mark(cudaStream_t stream) {
    if (used == marks.size()) {
      cudaEvent_t e;
      cuda::check_api(cudaEventCreate(&e), "cudaEventCreate");
      marks.push_back(e);
    }
    cuda::check_api(cudaEventRecord(marks[used++], stream), "cudaEventRecord");
  }
  // Seconds between the recorded pairs (the stream has been synchronized), then forgets them.
  double take_seconds() {
    double s = 0;
    for (size_t i = 0; i + 1 < used; i += 2) {
      float ms = 0;
      cuda::check_api(cudaEventElapsedTime(&ms, marks[i], marks[i + 1]), "cudaEventElapsedTime");
      s += ms * 1e-3;
    }
    used = 0;
    return s;
  }
};

namespace {

// Host 0's unique id, passed to the other hosts through a file (Ranks says how).
ncclUniqueId shared_unique_id(const Ranks& where) {
  ncclUniqueId id;
  if (where.hosts == 1) {
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return id;
  }
  const std::filesystem::path file = where.id_file;
  if (where.host == 0) {
    if (std::filesystem::exists(file)) {
      fail(ErrorCode::usage, {.field = "--nccl-id"},
           fmt::format("{} already exists: other hosts could read an earlier launch's id; remove it or name a new file",
                       file.string()));
    }
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    // Written under another name, then renamed, so no host reads half an id.
    const std::filesystem::path partial = file.string() + ".partial";
    {
      std::ofstream out(partial, std::ios::binary);
      out.write(id.internal, sizeof(id.internal));
      if (!out.flush()) fail(ErrorCode::usage, {.field = "--nccl-id"}, "cannot write " + partial.string());
    }
    std::filesystem::rename(partial, file);
    return id;
  }
  const auto deadline = std::chrono::steady_clock::now() + where.wait;
  while (true) {
    std::ifstream in(file, std::ios::binary);
    if (in && in.read(id.internal, sizeof(id.internal))) return id;
    if (std::chrono::steady_clock::now() > deadline) {
      fail(ErrorCode::usage, {.field = "--nccl-id"},
           fmt::format("host {} waited {} s for host 0 to write {}", where.host, where.wait.count(), file.string()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace

std::unique_ptr<ExpertParallelModel> ExpertParallelModel::create(const Model& model, const Ranks& where,
                                                                 const BackendChoices& target,
                                                                 const BackendChoices& draft) {
  where.check();
  const std::vector<cuda::DeviceInfo> found = cuda::devices();
  const int gpus = where.gpus;
  if (gpus > static_cast<int>(found.size())) {
    fail(ErrorCode::usage, {.field = "--gpus"}, fmt::format("{} GPUs asked for, {} present", gpus, found.size()));
  }
  for (int r = 1; r < gpus; ++r) {
    if (found[r].major != found[0].major || found[r].minor != found[0].minor) {
      fail(ErrorCode::usage, {.field = "--gpus"},
           fmt::format("GPU {} ({}) is another architecture than GPU 0 ({}): one plan serves every rank", r,
                       found[r].name, found[0].name));
    }
  }
  // NVLink multicast (NVLS) stays off unless the user turned it on explicitly.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::unique_ptr<ExpertParallelModel> m(new ExpertParallelModel);
  m->where_ = where;
  m->comms_ = std::make_unique<Comms>();
  Comms& comms = *m->comms_;
  comms.comms.resize(gpus);
  const ncclUniqueId id = shared_unique_id(where);
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int r = 0; r < gpus; ++r) {
    cuda::check_api(cudaSetDevice(r), "cudaSetDevice");
    check_nccl(ncclCommInitRank(&comms.comms[r], where.world(), id, where.first() + r), "ncclCommInitRank");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  // Every rank has joined, so no host needs the id any more: the path can serve the next launch.
  if (where.hosts > 1 && where.host == 0) std::filesystem::remove(where.id_file);
  for (int r = 0; r < gpus; ++r) {
    cuda::ExpertShare share{where.first() + r, ExpertSplit{where.world(), where.hosts},
                            [&comms, r](float* data, int64_t count, cudaStream_t stream) {
                              comms.all_reduce(r, data, count, stream);
                            }};
    m->ranks_.push_back(cuda::GpuModel::create(model, r, target, draft, std::move(share)));
  }
  return m;
}

ExpertParallelModel::~ExpertParallelModel() = default;

ExpertParallelModel::Sequence ExpertParallelModel::new_sequence() const {
  Sequence s;
  for (const auto& r : ranks_) s.ranks.push_back(r->new_sequence());
  return s;
}

std::vector<float> ExpertParallelModel::forward(Sequence& seq, std::span<const int32_t> tokens, LogitRows rows) {
  const Chunk chunk{&seq, tokens};
  return std::move(forward(std::span(&chunk, 1), rows).front());
}

void ExpertParallelModel::each_rank(const std::function<void(int rank)>& call) {
  const int n = gpus();
  std::vector<std::exception_ptr> errors(n);
  const auto run = [&](int r) {
    try {
      call(r);
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r) threads.emplace_back(run, r);
  run(0);
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  comm_seconds_ += comms_->take_seconds();  // rank 0's stream was synchronized by its call
}

template <typename Result, typename Call>
Result ExpertParallelModel::on_every_rank(std::span<const Chunk> batch, const Call& call) {
  const int n = gpus();
  for (const Chunk& c : batch) {
    if (!c.sequence || static_cast<int>(c.sequence->ranks.size()) != n) {
      fail(ErrorCode::usage, {}, "a batched forward chunk needs a sequence from this model");
    }
  }
  std::vector<Result> results(n);
  each_rank([&](int r) {
    std::vector<cuda::DeviceChunk> chunks;
    for (const Chunk& c : batch) chunks.push_back({&c.sequence->ranks[r], c.tokens});
    results[r] = call(*ranks_[r], std::span<const cuda::DeviceChunk>(chunks));
  });
  return std::move(results[0]);
}

std::vector<std::vector<float>> ExpertParallelModel::forward(std::span<const Chunk> batch, LogitRows rows) {
  return on_every_rank<std::vector<std::vector<float>>>(
      batch, [&](const cuda::GpuModel& m, std::span<const cuda::DeviceChunk> chunks) { return m.forward(chunks, rows); });
}

std::vector<std::optional<RowSummary>> ExpertParallelModel::forward(std::span<const Chunk> batch,
                                                                    std::span<const std::optional<RowChoice>> choices) {
  return on_every_rank<std::vector<std::optional<RowSummary>>>(
      batch, [&](const cuda::GpuModel& m, std::span<const cuda::DeviceChunk> chunks) { return m.forward(chunks, choices); });
}

std::string ExpertParallelModel::layout() const {
  std::string out = ranks_.front()->share().split.describe(ranks_.front()->config());
  if (where_.hosts > 1) {
    out += fmt::format("  this is host {} of {}: ranks {}..{} on its GPUs 0..{}\n", where_.host, where_.hosts,
                       where_.first(), where_.first() + gpus() - 1, gpus() - 1);
  }
  for (int r = 0; r < gpus(); ++r) {
    out += fmt::format("  rank {} holds {:.1f} MiB of weights\n", where_.first() + r, ranks_[r]->weight_bytes() / 1048576.0);
  }
  return out;
}

double ExpertParallelModel::all_reduce_seconds(int64_t floats, int iterations) {
  const int n = gpus();
  std::vector<cuda::DeviceBuffer<float>> buffers;
  std::vector<cudaStream_t> streams(n);
  for (int r = 0; r < n; ++r) {
    cuda::check_api(cudaSetDevice(r), "cudaSetDevice");
    buffers.emplace_back(static_cast<size_t>(floats));
    cuda::check_api(cudaMemset(buffers.back().data(), 0, floats * sizeof(float)), "cudaMemset");
    cuda::check_api(cudaStreamCreate(&streams[r]), "cudaStreamCreate");
  }
  // Timed as the forward pass sees it: each rank's thread launches its own calls back to
  // back on its stream (no group: a single thread launching for every rank would time its
  // launches, not the link), CUDA events on the first rank's stream.
  cudaEvent_t start, stop;
  cuda::check_api(cudaSetDevice(0), "cudaSetDevice");
  cuda::check_api(cudaEventCreate(&start), "cudaEventCreate");
  cuda::check_api(cudaEventCreate(&stop), "cudaEventCreate");
  const auto round = [&](int count) {
    each_rank([&](int r) {
      cuda::check_api(cudaSetDevice(r), "cudaSetDevice");
      if (r == 0) cuda::check_api(cudaEventRecord(start, streams[0]), "cudaEventRecord");
      for (int i = 0; i < count; ++i) {
        check_nccl(ncclAllReduce(buffers[r].data(), buffers[r].data(), static_cast<size_t>(floats), ncclFloat, ncclSum,
                                 comms_->comms[r], streams[r]),
                   "ncclAllReduce");
      }
      if (r == 0) cuda::check_api(cudaEventRecord(stop, streams[0]), "cudaEventRecord");
      cuda::check_api(cudaStreamSynchronize(streams[r]), "cudaStreamSynchronize");
    });
    float ms = 0;
    cuda::check_api(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return ms * 1e-3 / count;
  };
  round(5);  // warm-up: NCCL sets up its channels on first use
  double best = 1e30;
  for (int k = 0; k < 3; ++k) best = std::min(best, round(iterations));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (int r = 0; r < n; ++r) {
    cudaSetDevice(r);
    cudaStreamDestroy(streams[r]);
  }
  return best;
}

}  // namespace keel::parallel
