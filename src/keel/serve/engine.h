// The serving engine: one thread that owns the model's compute and runs every admitted
// request in a continuous batch (docs/serve.md).
//
// Each step
//   1. drops requests that were cancelled or passed their deadline (their state freed),
//   2. admits queued requests, by priority and then in arrival order, while fewer than
//      max_running run and their first chunk fits the budget beside the running
//      requests' next chunks (prefix snapshots are evicted to make room; a preempted
//      request waits until its last size fits again),
//   3. spends a token budget: one token for every decoding request first, then prompt
//      chunks of at most prefill_chunk tokens per request, oldest first, so a long
//      prompt never stalls decoding,
//   4. reserves the state the step may add (Executor::state_growth): prefix snapshots
//      are evicted first, then the lowest-priority request (the newest among equals) is
//      preempted: its state is dropped and it is queued first among its priority, to
//      recompute its prompt and generated tokens later. The forward pass is exact under
//      any chunking and the request keeps its sampler, so it produces the same tokens.
//   5. runs one batched forward over every request's chunk, samples the next token of
//      every request whose input is all processed, decodes it, applies EOS / stop
//      strings / max_tokens and hands the new text to the request's sink; a step of
//      decoding requests alone, whose tokens the executor can pick without the host
//      (greedy or whole-row sampling), may be pipelined (EngineLimits::pipelined): the next
//      step is begun before this one's tokens are read, its tokens picked from this
//      one's summaries (Executor::begin_choices), while nothing is queued,
//   6. keeps a snapshot of a request's state at each prompt block boundary it reaches
//      (prefix caching; a new request resumes from the longest cached prefix of its
//      prompt). On the CPU the state is paged (model/block_pool.h) and a snapshot
//      shares the request's blocks.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "model/executor.h"
#include "model/model.h"
#include "ops/sampling.h"
#include "serve/metrics.h"
#include "serve/prefix_cache.h"
#include "tokenizer/tokenizer.h"

namespace keel::serve {

struct EngineLimits {
  int max_running = 16;         // requests in the batch at once
  int max_queued = 256;         // waiting requests; past it submit() refuses (HTTP 503)
  int step_tokens = 256;        // tokens one step forwards, all requests together
  int prefill_chunk = 64;       // prompt tokens one request forwards per step
  uint64_t state_bytes = 256ull << 20;  // sequence-state budget: running requests and prefix snapshots
  uint64_t prefix_cache_bytes = 64ull << 20;  // at most this much state referred to by prefix snapshots (0: none)
  int prefix_block = 64;        // prompt prefixes are cached at multiples of this
  std::chrono::milliseconds timeout{600'000};  // per request, from submission
  // Decode steps begun a step ahead where every request's next token can be picked by
  // the executor (docs/serve.md). The tokens are the same either way; the throughput is
  // a little higher (tools/serve_load.py, docs/perf.md).
  bool pipelined = true;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;  // generation ends before the first one; it is not returned
  bool ignore_eos = false;
  int priority = 0;               // lower runs first and is preempted last (as vLLM's `priority`)
  bool skip_special = false;      // leave special tokens out of the text
  int top_logprobs = -1;          // -1: no logprobs; 0..20: the chosen token's and that many others
};

enum class Finish : uint8_t { none, stop, length, cancelled, timeout, error };
std::string_view name(Finish finish);

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// One sampled token (or the end). `text` is what became visible with it: a stop string's
// possible beginning is held back, and nothing after a stop string is ever sent.
struct GenerationEvent {
  std::string text;
  std::optional<int32_t> token;
  std::optional<TokenLogprob> logprob;
  Finish finish = Finish::none;
  std::string error;  // Finish::error
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

// Called on the engine thread, in order, the last time with finish != none. Must not block.
using Sink = std::function<void(GenerationEvent&&)>;

class RequestHandle {
 public:
  // The request stops at the next step and frees its state; its sink then gets
  // Finish::cancelled (unless it finished first).
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  std::atomic<bool> cancelled_{false};
};

struct EngineStats {
  size_t queued = 0, running = 0;
  uint64_t state_bytes = 0;   // the running requests' state
  uint64_t state_in_use = 0;  // what the budget limits: running requests and prefix snapshots
  uint64_t preemptions = 0;  // since the start
  uint64_t pipelined_steps = 0;  // steps begun before the step before was read, since the start
};

class Engine {
 public:
  // Runs `executor` (CPU or GPU; model/executor.h) for `model`'s config.
  Engine(const Model& model, const Executor& executor, const Tokenizer& tokenizer, EngineLimits limits = {});
  // On the CPU.
  Engine(const Model& model, const Tokenizer& tokenizer, EngineLimits limits = {});
  ~Engine();  // stops the thread; requests still present get Finish::cancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; nullptr when the queue is full. Throws Error(bad_input) for an
  // empty prompt, ids outside the vocabulary, bad sampling parameters, max_tokens < 1 or
  // a prompt that leaves no room in the context.
  std::shared_ptr<RequestHandle> submit(GenerationRequest request, Sink sink);

  EngineStats stats() const;
  const EngineLimits& limits() const { return limits_; }
  const Model& model() const { return model_; }
  // Prometheus text of the engine's metrics (keel_ names).
  void write_metrics(std::string& out) const;

 private:
  struct Active;
  // A step begun and not yet read (its summaries come from Executor::finish_choices):
  // each chunk's request, and what must outlive the step: the requests that ended while
  // it ran (a request's last token can come a step after the next was begun) and their
  // state.
  struct Flight {
    std::vector<Active*> rows;
    std::vector<std::unique_ptr<Active>> ended;
    std::vector<std::unique_ptr<SequenceState>> states;
    bool holds(const Active* a) const;
  };
  void start();  // checks the limits, starts the thread
  void enqueue(std::unique_ptr<Active> a, bool first_of_priority);  // mutex_ held
  void preempt(std::unique_ptr<Active> a);  // mutex_ held
  std::unique_ptr<SequenceState> resume(std::span<const int32_t> prompt);
  uint64_t admission_bytes(const Active& a) const;
  uint64_t running_growth() const;
  bool make_room(const std::function<uint64_t()>& need);
  void reserve_state(std::vector<std::pair<Active*, int>>& work);
  void remember_prefix(const Active& a);
  void loop();
  bool step();  // false when idle
  bool continues() const;  // whether the flight's requests can run the next step, pipelined
  void continue_flight();
  void begin(std::vector<std::pair<Active*, int>>& work, std::vector<SequenceChunk>& chunks,
             std::vector<std::optional<RowChoice>>& choices);
  void settle();  // reads the flight's tokens; none is then begun
  void read(Flight& flight);
  void retire_done();
  void update_stats();  // the running requests' state and the prefix cache's, for stats()
  void release(Active& a);  // frees a's state, or keeps it until the flight that runs it is read
  void finish(Active& a, Finish why, std::string error = {});
  void emit_token(Active& a, int32_t token, const RowSummary& row);

  const Model& model_;
  std::unique_ptr<Executor> cpu_;  // when constructed for the CPU
  const Executor* executor_;
  const Tokenizer& tokenizer_;
  EngineLimits limits_;
  PrefixCache prefix_cache_;  // engine thread only

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Active>> queue_;  // guarded by mutex_
  bool stopping_ = false;                       // guarded by mutex_
  std::vector<std::unique_ptr<Active>> running_;  // engine thread only
  std::optional<Flight> flight_;                  // engine thread only
  std::atomic<size_t> running_count_{0};
  std::atomic<uint64_t> state_bytes_{0}, state_in_use_{0};
  uint64_t next_order_ = 0;

  EngineMetrics metrics_;
  std::thread thread_;
};

}  // namespace keel::serve
