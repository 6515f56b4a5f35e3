// One sequence of a loaded model on the device the user chose (--device cpu, cuda or
// cuda:N): what keel run, keel logits and keel bench drive, whatever the backend.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cli/load_model.h"

namespace keel::cli {

class Runner {
 public:
  virtual ~Runner() = default;
  virtual void reset() = 0;  // starts a fresh sequence
  // Model::forward on the current sequence.
  virtual std::vector<float> forward(std::span<const int32_t> tokens, LogitRows rows = LogitRows::all) = 0;
  virtual int64_t length() const = 0;  // tokens in the sequence
  virtual const Plan& plan() const = 0;
  virtual std::string device() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  // The bandwidth a decode step is held to on this device, bytes/s, measured now over a
  // buffer of `bytes`: CPU read bandwidth, GPU device-to-device copy bandwidth.
  virtual double measure_bandwidth(uint64_t bytes) const = 0;

  // Several GPUs: seconds spent in communication since the last reset (0 otherwise),
  // and the floor measured now: seconds of one all-reduce of `floats` values.
  virtual void reset_communication() {}
  virtual double communication_seconds() const { return 0; }
  virtual double all_reduce_floor(int64_t /*floats*/) { return 0; }

  // GPUs: seconds per stage of the forward pass, summed over the calls since profiling
  // was turned on (rank 0's with several GPUs); empty where there is no profile.
  virtual void set_profiling(bool /*on*/) {}
  virtual std::map<std::string, double> profile() const { return {}; }
};

// The model, loaded on the host, and a runner on options.device (cpu unless given).
// A GPU runner plans with the user's kernel choices for the GPU's architecture, and
// the host model keeps the CPU's automatic choices. Unless quiet, prints the plan's
// summary (and, with --verbose, the table) of the device that runs.
struct Loaded {
  std::unique_ptr<Model> model;
  std::unique_ptr<Runner> runner;
};
Loaded load_runner(const std::string& directory, bool quiet, const KernelOptions& options);

}  // namespace keel::cli
