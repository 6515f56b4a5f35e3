#include "model/executor.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <fmt/format.h>

#include "base/error.h"

namespace keel {
namespace {

struct CpuSequence final : SequenceState {
  Sequence sequence;
  int64_t length() const override { return sequence.length; }
  uint64_t bytes() const override { return sequence.state_bytes(); }
};

// Each chunk's last row of logits summarized for its choice (none: no summary).
std::vector<std::optional<RowSummary>> summarize_choices(const std::vector<std::vector<float>>& logits,
                                                         std::span<const std::optional<RowChoice>> choices) {
  std::vector<std::optional<RowSummary>> out(choices.size());
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i]) out[i] = summarize_for(logits[i], *choices[i]);
  }
  return out;
}

void check_choices(std::span<const SequenceChunk> batch, std::span<const std::optional<RowChoice>> choices) {
  if (choices.size() != batch.size()) fail(ErrorCode::usage, {}, "forward_choices: one choice (or none) per chunk");
}

}  // namespace

std::vector<std::vector<float>> Executor::forward_batch(std::span<const SequenceChunk> batch, LogitRows rows) const {
  std::vector<std::vector<float>> logits;
  for (const SequenceChunk& chunk : batch) logits.push_back(forward(*chunk.sequence, chunk.tokens, rows));
  return logits;
}

std::vector<std::optional<RowSummary>> Executor::forward_choices(std::span<const SequenceChunk> batch,
                                                                 std::span<const std::optional<RowChoice>> choices) const {
  check_choices(batch, choices);
  return summarize_choices(forward_batch(batch, LogitRows::last), choices);
}

void Executor::begin_choices(std::span<const SequenceChunk> batch,
                             std::span<const std::optional<RowChoice>> choices) const {
  check_choices(batch, choices);
  if (ran_.size() >= 2) fail(ErrorCode::usage, {}, "two calls are begun and not finished: finish one first");
  // Each picked chunk's token, chosen here from the call before's summary.
  std::vector<int32_t> picked(batch.size());
  std::vector<SequenceChunk> chunks(batch.begin(), batch.end());
  for (size_t i = 0; i < chunks.size(); ++i) {
    SequenceChunk& chunk = chunks[i];
    if (chunk.pick_of < 0) continue;
    if (!chunk.tokens.empty()) fail(ErrorCode::usage, {}, "a chunk that takes its token from the call before has tokens too");
    if (ran_.empty()) fail(ErrorCode::usage, {}, "a chunk takes its token from the call before, but no call is begun");
    const Ran& before = ran_.back();
    const auto from = static_cast<size_t>(chunk.pick_of);
    if (from >= before.choices.size() || !before.summaries[from] ||
        pick_kind(before.choices[from]->params) == PickKind::candidates) {
      fail(ErrorCode::usage, {},
           fmt::format("chunk {} of the call before has no token the device picks (no choice, or a draw among "
                       "candidates, which the host makes)",
                       chunk.pick_of));
    }
    picked[i] = choose(before.choices[from]->params, before.choices[from]->draw, *before.summaries[from]);
    chunk.tokens = std::span(&picked[i], 1);
    chunk.pick_of = -1;
  }
  std::vector<std::optional<RowSummary>> summaries = forward_choices(chunks, choices);
  ran_.push_back({{choices.begin(), choices.end()}, std::move(summaries)});
}

std::vector<std::optional<RowSummary>> Executor::finish_choices() const {
  if (ran_.empty()) fail(ErrorCode::usage, {}, "finish_choices: no call is begun");
  std::vector<std::optional<RowSummary>> out = std::move(ran_.front().summaries);
  ran_.erase(ran_.begin());
  return out;
}

std::unique_ptr<SpeculativeTarget> Executor::speculative_target() const {
  fail(ErrorCode::usage, {.field = "--speculative"}, "speculative decoding is not available on " + device());
}

CpuExecutor::CpuExecutor(const Model& model)
    : model_(model), pool_(std::make_shared<HostBlockPool>(model.state_block_floats())) {}

std::unique_ptr<SequenceState> CpuExecutor::new_sequence() const {
  auto s = std::make_unique<CpuSequence>();
  s->sequence = model_.new_sequence(pool_);
  return s;
}

uint64_t CpuExecutor::state_in_use() const { return static_cast<uint64_t>(pool_->used()) * pool_->block_bytes(); }

uint64_t CpuExecutor::state_growth(const SequenceState* sequence, int64_t tokens) const {
  const int64_t blocks = sequence ? model_.blocks_needed(static_cast<const CpuSequence*>(sequence)->sequence, tokens)
                                  : model_.blocks_needed(model_.new_sequence(pool_), tokens);
  return static_cast<uint64_t>(blocks) * pool_->block_bytes();
}

void CpuExecutor::limit_state(uint64_t bytes) const {
  pool_->set_capacity(static_cast<int64_t>(std::min<uint64_t>(bytes / pool_->block_bytes(), INT64_MAX)));
}

std::unique_ptr<SequenceState> CpuExecutor::clone(const SequenceState& sequence) const {
  return std::make_unique<CpuSequence>(static_cast<const CpuSequence&>(sequence));
}

std::vector<float> CpuExecutor::forward(SequenceState& sequence, std::span<const int32_t> tokens,
                                       LogitRows rows) const {
  return model_.forward(static_cast<CpuSequence&>(sequence).sequence, tokens, rows);
}

std::vector<std::vector<float>> CpuExecutor::run(std::span<const SequenceChunk> batch,
                                                 std::span<const int64_t> head_rows) const {
  std::vector<Model::Chunk> chunks;
  for (const SequenceChunk& c : batch) chunks.push_back({&static_cast<CpuSequence*>(c.sequence)->sequence, c.tokens});
  return model_.forward(chunks, head_rows);
}

std::vector<std::vector<float>> CpuExecutor::forward_batch(std::span<const SequenceChunk> batch, LogitRows rows) const {
  std::vector<int64_t> head_rows;
  for (const SequenceChunk& c : batch) {
    head_rows.push_back(rows == LogitRows::last ? 1 : static_cast<int64_t>(c.tokens.size()));
  }
  return run(batch, head_rows);
}

std::vector<std::optional<RowSummary>> CpuExecutor::forward_choices(std::span<const SequenceChunk> batch,
                                                                    std::span<const std::optional<RowChoice>> choices) const {
  check_choices(batch, choices);
  std::vector<int64_t> head_rows;
  for (const auto& choice : choices) head_rows.push_back(choice ? 1 : 0);
  return summarize_choices(run(batch, head_rows), choices);
}

std::string CpuExecutor::device() const { return fmt::format("cpu ({} threads)", omp_get_max_threads()); }

// Read bandwidth over a buffer far larger than the caches, all threads, best of 5.
double CpuExecutor::measure_bandwidth(uint64_t bytes) const {
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

}  // namespace keel
