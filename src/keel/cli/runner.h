// The executor the user chose (--device cpu, cuda or cuda:N; --gpus N) for keel run,
// logits, bench and serve, and one sequence on it for the commands that run one.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cli/load_model.h"
#include "model/executor.h"

namespace keel::cli {

// The model, loaded on the host, and the executor that runs it. A GPU executor plans with
// the user's kernel choices for the GPU's architecture, and the host model keeps the
// CPU's automatic choices. Unless quiet, prints the plan's summary (and, with
// --verbose, the table) of the device that runs.
struct Loaded {
  std::unique_ptr<Model> model;
  std::unique_ptr<Executor> executor;
};
Loaded load_executor(const std::string& directory, bool quiet, const KernelOptions& options);

// One sequence on an executor.
class Runner {
 public:
  explicit Runner(Executor& executor) : executor_(executor), sequence_(executor.new_sequence()) {}
  void reset() { sequence_ = executor_.new_sequence(); }
  std::vector<float> forward(std::span<const int32_t> tokens, LogitRows rows = LogitRows::all) {
    return executor_.forward(*sequence_, tokens, rows);
  }
  // Runs `tokens` and chooses the token after them with `sampler` (the logits are
  // summarized where they were computed: on a GPU only the summary comes back).
  int32_t next(std::span<const int32_t> tokens, Sampler& sampler) {
    const SequenceChunk chunk{sequence_.get(), tokens};
    const std::optional<RowChoice> choice = RowChoice{sampler.params(), sampler.draws(), 1};
    return sampler.next(*executor_.forward_choices(std::span(&chunk, 1), std::span(&choice, 1)).front());
  }
  // Runs `tokens` without computing any logits (a prompt's chunks before its last).
  void prefill(std::span<const int32_t> tokens) {
    const SequenceChunk chunk{sequence_.get(), tokens};
    const std::optional<RowChoice> none;
    executor_.forward_choices(std::span(&chunk, 1), std::span(&none, 1));
  }
  int64_t length() const { return sequence_->length(); }
  SequenceState& sequence() { return *sequence_; }
  Executor& executor() { return executor_; }

 private:
  Executor& executor_;
  std::unique_ptr<SequenceState> sequence_;
};

}  // namespace keel::cli
