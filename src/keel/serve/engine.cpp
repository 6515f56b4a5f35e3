#include "serve/engine.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <numeric>

#include "base/error.h"

namespace keel::serve {

using Clock = std::chrono::steady_clock;

std::string_view name(Finish finish) {
  switch (finish) {
    case Finish::none: return "none";
    case Finish::stop: return "stop";
    case Finish::length: return "length";
    case Finish::cancelled: return "cancelled";
    case Finish::timeout: return "timeout";
    case Finish::error: return "error";
  }
  return "?";
}

struct Engine::Active {
  GenerationRequest request;
  Sink sink;
  std::shared_ptr<RequestHandle> handle;
  Sampler sampler;
  StreamDecoder decoder;
  std::unique_ptr<SequenceState> sequence;  // null while queued or preempted
  int64_t done_tokens() const { return sequence ? sequence->length() : 0; }
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int generated = 0;
  std::string held;           // decoded text that may begin a stop string
  Clock::time_point submitted, deadline, last_token;
  uint64_t order = 0;         // admission order: the largest is the newest
  uint64_t need_bytes = 0;    // state size when last preempted
  bool done = false;

  Active(GenerationRequest r, Sink s, const Tokenizer& tokenizer)
      : request(std::move(r)), sink(std::move(s)), handle(std::make_shared<RequestHandle>()),
        sampler(request.sampling), decoder(tokenizer, request.skip_special) {}
};

namespace {

// The longest suffix of `text` that is a proper prefix of some stop string.
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stop) {
  size_t keep = 0;
  for (const auto& s : stop) {
    for (size_t n = std::min(s.size() - 1, text.size()); n > keep; --n) {
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  return keep;
}

// The chosen token's logprob and the `top` most likely, from the row's summary (which
// lists at least that many candidates).
TokenLogprob logprobs_of(const RowSummary& row, int32_t chosen, int top) {
  TokenLogprob out{.id = chosen, .logprob = logprob_of(row, chosen)};
  const size_t k = std::min(static_cast<size_t>(std::max(top, 0)), row.ids.size());
  for (size_t i = 0; i < k; ++i) out.top.emplace_back(row.ids[i], row.logits[i] - row.log_z);
  return out;
}

}  // namespace

Engine::Engine(const Model& model, const Tokenizer& tokenizer, EngineLimits limits)
    : model_(model), cpu_(std::make_unique<CpuExecutor>(model)), executor_(cpu_.get()), tokenizer_(tokenizer),
      limits_(limits), prefix_cache_(limits.prefix_cache_bytes, limits.prefix_block) {
  start();
}

Engine::Engine(const Model& model, const Executor& executor, const Tokenizer& tokenizer, EngineLimits limits)
    : model_(model), executor_(&executor), tokenizer_(tokenizer), limits_(limits),
      prefix_cache_(limits.prefix_cache_bytes, limits.prefix_block) {
  start();
}

void Engine::start() {
  if (limits_.max_running < 1 || limits_.max_queued < 0 || limits_.step_tokens < 1 || limits_.prefill_chunk < 1 ||
      limits_.prefix_block < 1) {
    fail(ErrorCode::usage, {.field = "engine limits"},
         "max running, step tokens, prefill chunk and prefix block must be >= 1, max queued >= 0");
  }
  executor_->limit_state(limits_.state_bytes);
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (auto& a : running_) finish(*a, Finish::cancelled);
  for (auto& a : queue_) finish(*a, Finish::cancelled);
}

std::shared_ptr<RequestHandle> Engine::submit(GenerationRequest request, Sink sink) {
  const ModelConfig& c = model_.config();
  if (request.prompt.empty()) fail(ErrorCode::bad_input, {.field = "prompt"}, "the prompt is empty");
  for (int32_t id : request.prompt) {
    if (id < 0 || id >= c.vocab_size) {
      fail(ErrorCode::bad_input, {.field = "prompt"}, fmt::format("token id {} is outside the vocabulary (0..{})", id, c.vocab_size - 1));
    }
  }
  if (request.max_tokens < 1) fail(ErrorCode::bad_input, {.field = "max_tokens"}, "must be >= 1");
  if (static_cast<int64_t>(request.prompt.size()) >= c.max_position_embeddings) {
    fail(ErrorCode::bad_input, {.field = "prompt"},
         fmt::format("the prompt has {} tokens; this model's context is {} tokens", request.prompt.size(),
                     c.max_position_embeddings));
  }
  if (request.top_logprobs > 20) fail(ErrorCode::bad_input, {.field = "top_logprobs"}, "must be <= 20");
  auto active = std::make_unique<Active>(std::move(request), std::move(sink), tokenizer_);  // checks sampling
  active->tokens = active->request.prompt;
  active->submitted = Clock::now();
  active->deadline = active->submitted + limits_.timeout;
  auto handle = active->handle;
  {
    std::lock_guard lock(mutex_);
    size_t waiting = 0;
    for (const auto& q : queue_) waiting += q->order == 0;  // preempted requests do not count
    if (waiting >= static_cast<size_t>(limits_.max_queued)) {
      metrics_.requests_rejected++;
      return nullptr;
    }
    enqueue(std::move(active), false);
  }
  metrics_.requests_submitted++;
  wake_.notify_one();
  return handle;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mutex_);
  return {.queued = queue_.size(),
          .running = running_count_.load(),
          .state_bytes = state_bytes_.load(),
          .state_in_use = state_in_use_.load(),
          .preemptions = metrics_.preemptions.load(),
          .pipelined_steps = metrics_.pipelined_steps.load()};
}

void Engine::finish(Active& a, Finish why, std::string error) {
  if (a.done) return;
  a.done = true;
  release(a);
  metrics_.finished.add(std::string(name(why)));
  metrics_.e2e.observe(std::chrono::duration<double>(Clock::now() - a.submitted).count());
  GenerationEvent ev{.finish = why,
                     .error = std::move(error),
                     .prompt_tokens = static_cast<int>(a.request.prompt.size()),
                     .completion_tokens = a.generated};
  a.sink(std::move(ev));
}

void Engine::emit_token(Active& a, int32_t token, const RowSummary& row) {
  const auto now = Clock::now();
  ++a.generated;
  a.tokens.push_back(token);
  metrics_.generation_tokens++;
  if (a.generated == 1) {
    metrics_.ttft.observe(std::chrono::duration<double>(now - a.submitted).count());
  } else {
    metrics_.tpot.observe(std::chrono::duration<double>(now - a.last_token).count());
  }
  a.last_token = now;

  GenerationEvent ev{.token = token};
  if (a.request.top_logprobs >= 0) ev.logprob = logprobs_of(row, token, a.request.top_logprobs);
  Finish why = Finish::none;
  bool stop_string = false;
  if (!a.request.ignore_eos && token == model_.config().eos_token_id) {
    why = Finish::stop;
  } else {
    a.decoder.push(token, a.held);
    size_t at = std::string::npos;
    for (const auto& s : a.request.stop) {
      if (s.empty()) continue;
      at = std::min(at, a.held.find(s));
    }
    if (at != std::string::npos) {
      ev.text = a.held.substr(0, at);
      a.held.clear();
      why = Finish::stop;
      stop_string = true;
    }
  }
  if (why == Finish::none && a.generated >= a.request.max_tokens) why = Finish::length;
  if (why == Finish::none && static_cast<int64_t>(a.tokens.size()) >= model_.config().max_position_embeddings) {
    why = Finish::length;
  }
  if (why == Finish::none) {
    const size_t keep = stop_holdback(a.held, a.request.stop);
    ev.text = a.held.substr(0, a.held.size() - keep);
    a.held.erase(0, a.held.size() - keep);
  } else if (!stop_string) {
    a.held += a.decoder.flush();
    ev.text = std::move(a.held);
    a.held.clear();
  }
  ev.prompt_tokens = static_cast<int>(a.request.prompt.size());
  ev.completion_tokens = a.generated;
  if (why != Finish::none) {
    ev.finish = why;
    a.done = true;
    release(a);
    metrics_.finished.add(std::string(name(why)));
    metrics_.e2e.observe(std::chrono::duration<double>(now - a.submitted).count());
  }
  a.sink(std::move(ev));
}

void Engine::loop() {
  while (step()) {
  }
}

// A fresh sequence, or a copy of the longest cached prefix of the prompt (leaving at
// least one prompt token to run, whose logits give the first sampled token).
std::unique_ptr<SequenceState> Engine::resume(std::span<const int32_t> prompt) {
  const auto [length, state] = prefix_cache_.longest(prompt, static_cast<int64_t>(prompt.size()) - 1);
  return state ? executor_->clone(*state) : executor_->new_sequence();
}

// After a forward that ended on a block boundary inside the prompt: keep a snapshot.
void Engine::remember_prefix(const Active& a) {
  const int64_t done = a.done_tokens();
  if (done == 0 || done % prefix_cache_.block() != 0 || done >= static_cast<int64_t>(a.request.prompt.size())) return;
  const auto prefix = std::span(a.request.prompt).first(static_cast<size_t>(done));
  if (prefix_cache_.wants(prefix)) prefix_cache_.insert(prefix, executor_->clone(*a.sequence));
}

// The running request to preempt first: the lowest priority (largest value), the newest
// among equals.
template <typename Requests>
auto lowest_priority(Requests& running) {
  return std::max_element(running.begin(), running.end(), [](const auto& x, const auto& y) {
    return std::pair(x->request.priority, x->order) < std::pair(y->request.priority, y->order);
  });
}

// The state a queued request needs before it is admitted: its size when it was
// preempted, or what its first prompt chunk adds to a fresh sequence. It is admitted
// when that fits beside what the running requests' next chunks may add, so a request
// is not admitted only to be preempted by the same step's reservation.
uint64_t Engine::admission_bytes(const Active& a) const {
  if (a.need_bytes) return a.need_bytes;
  const auto first = std::min<int64_t>(static_cast<int64_t>(a.tokens.size()), limits_.prefill_chunk);
  return executor_->state_growth(nullptr, first);
}

// What the running requests' next chunks may add to the state: a token for each decoding
// request, a prompt chunk for the others (at most; a step's token budget may run fewer).
uint64_t Engine::running_growth() const {
  uint64_t bytes = 0;
  for (const auto& a : running_) {
    const int64_t pending = static_cast<int64_t>(a->tokens.size()) - a->done_tokens();
    bytes += executor_->state_growth(a->sequence.get(), std::clamp<int64_t>(pending, 1, limits_.prefill_chunk));
  }
  return bytes;
}

// Whether `need()` more state fits the budget, evicting prefix snapshots (least
// recently used first) until it does or none is left. The need is asked again after each
// eviction: blocks a snapshot no longer shares need no copy.
bool Engine::make_room(const std::function<uint64_t()>& need) {
  while (executor_->state_in_use() + need() > limits_.state_bytes) {
    if (!prefix_cache_.evict_oldest()) return false;
  }
  return true;
}

// Before a step runs, the state it may add must fit: prefix snapshots go first, then the
// lowest-priority running requests (preempted: their work leaves the step). A request
// that cannot fit even alone ends with an error. So the forward never runs out of state
// memory part-way (on the CPU the pool's capacity is the budget: it would fail).
void Engine::reserve_state(std::vector<std::pair<Active*, int>>& work) {
  const auto growth = [&] {
    uint64_t bytes = 0;
    for (const auto& [a, n] : work) bytes += executor_->state_growth(a->sequence.get(), n);
    return bytes;
  };
  while (!make_room(growth)) {
    if (running_.size() > 1) {
      const auto lowest = lowest_priority(running_);
      std::erase_if(work, [&](const auto& w) { return w.first == lowest->get(); });
      std::unique_ptr<Active> a = std::move(*lowest);
      running_.erase(lowest);
      std::lock_guard lock(mutex_);
      preempt(std::move(a));
      continue;
    }
    const uint64_t in_use = executor_->state_in_use(), need = growth();
    for (const auto& [a, n] : work) {
      finish(*a, Finish::error,
             fmt::format("the request's state would grow to {} bytes, past the state budget ({} bytes)",
                         in_use + need, limits_.state_bytes));
    }
    work.clear();
    return;
  }
}

// Drops a running request's state and queues it again, first of its priority (the
// caller holds mutex_). It is recomputed from its prompt and the tokens it generated.
void Engine::preempt(std::unique_ptr<Active> a) {
  a->need_bytes = a->sequence->bytes();
  a->sequence.reset();
  metrics_.preemptions++;
  enqueue(std::move(a), true);
}

// The queue is ordered by priority; within one priority, arrivals go last and preempted
// requests first (they already waited).
void Engine::enqueue(std::unique_ptr<Active> a, bool first_of_priority) {
  const int p = a->request.priority;
  const auto at = std::find_if(queue_.begin(), queue_.end(), [&](const auto& q) {
    return first_of_priority ? q->request.priority >= p : q->request.priority > p;
  });
  queue_.insert(at, std::move(a));
}

bool Engine::step() {
  std::vector<std::unique_ptr<Active>> dropped;  // cancelled or timed out while queued
  const auto now = Clock::now();
  bool queued = false;
  {
    std::unique_lock lock(mutex_);
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty() || !running_.empty() || flight_; });
    if (stopping_) {
      lock.unlock();
      if (flight_) settle();
      return false;
    }
    for (auto it = queue_.begin(); it != queue_.end();) {
      if ((*it)->handle->cancelled() || now > (*it)->deadline) {
        dropped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    queued = !queue_.empty();
  }
  for (auto& a : dropped) finish(*a, a->handle->cancelled() ? Finish::cancelled : Finish::timeout);
  dropped.clear();
  // A begun step goes on, pipelined, while its requests all run it and nothing waits to
  // be admitted; otherwise it is read first, so that admission, preemption and prefix
  // snapshots see every request's state as it is.
  if (flight_ && !queued && continues()) {
    continue_flight();
    return true;
  }
  if (flight_) settle();
  {
    std::unique_lock lock(mutex_);
    while (!queue_.empty()) {
      Active& a = *queue_.front();
      const bool room = running_.size() < static_cast<size_t>(limits_.max_running) &&
                        (running_.empty() || make_room([&] { return admission_bytes(a) + running_growth(); }));
      if (!room) {
        // No room: a waiting request of higher priority (a smaller value) than the lowest
        // running one takes its place; the preempted one is recomputed later, exactly.
        const auto lowest = lowest_priority(running_);
        if (lowest == running_.end() || (*lowest)->request.priority <= a.request.priority) break;
        std::unique_ptr<Active> out = std::move(*lowest);
        running_.erase(lowest);
        preempt(std::move(out));
        continue;
      }
      if (a.order == 0) metrics_.prompt_tokens += a.request.prompt.size();
      a.order = ++next_order_;
      a.sequence = resume(a.request.prompt);
      running_.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    running_count_ = running_.size();
  }

  for (auto& a : running_) {
    if (a->handle->cancelled()) finish(*a, Finish::cancelled);
    else if (now > a->deadline) finish(*a, Finish::timeout);
  }
  std::erase_if(running_, [](const auto& a) { return a->done; });

  // The step's work: every decoding request one token, then prompt chunks.
  int budget = limits_.step_tokens;
  std::vector<std::pair<Active*, int>> work;
  for (auto& a : running_) {
    if (!a->done && static_cast<int64_t>(a->tokens.size()) - a->done_tokens() == 1 && budget > 0) {
      work.emplace_back(a.get(), 1);
      --budget;
    }
  }
  for (auto& a : running_) {
    const int64_t pending = static_cast<int64_t>(a->tokens.size()) - a->done_tokens();
    if (a->done || pending <= 1 || budget == 0) continue;
    int n = static_cast<int>(std::min<int64_t>({pending, limits_.prefill_chunk, budget}));
    // Chunks end at the prompt's block boundaries, where its state is worth a snapshot.
    const int64_t done = a->done_tokens(), block = prefix_cache_.block();
    if (prefix_cache_.enabled() && done < static_cast<int64_t>(a->request.prompt.size())) {
      n = static_cast<int>(std::min<int64_t>(n, (done / block + 1) * block - done));
    }
    work.emplace_back(a.get(), n);
    budget -= n;
  }
  reserve_state(work);
  metrics_.steps++;
  if (!work.empty()) {
    metrics_.batch_size.observe(static_cast<double>(work.size()));
    metrics_.step_tokens.observe(limits_.step_tokens - budget);
  }
  // One batched forward for the whole step: every weight is read once for all requests.
  // The chunks that end a request's known tokens get a choice; only their rows' sampling
  // summaries come back.
  std::vector<SequenceChunk> chunks;
  std::vector<std::optional<RowChoice>> choices;
  for (auto& [a, n] : work) {
    chunks.push_back({a->sequence.get(), std::span(a->tokens).subspan(a->done_tokens(), n)});
    if (a->done_tokens() + n == static_cast<int64_t>(a->tokens.size())) {
      choices.push_back(RowChoice{a->request.sampling, a->sampler.draws(), std::max(1, a->request.top_logprobs)});
    } else {
      choices.emplace_back();
    }
  }
  begin(work, chunks, choices);
  // A step whose requests' next tokens the executor picks stays begun, to be read once
  // the next step is begun (pipelined); any other is read now.
  const bool pickable = flight_ && std::all_of(flight_->rows.begin(), flight_->rows.end(), [&](const Active* a) {
    return !a->done && a->done_tokens() == static_cast<int64_t>(a->tokens.size()) &&
           executor_->picks(a->request.sampling);
  });
  if (flight_ && !(limits_.pipelined && pickable)) settle();
  update_stats();
  return true;
}

// Begins the step's call (Executor::begin_choices) as the flight; a call that fails ends
// its requests with the error, and the other running requests go on.
void Engine::begin(std::vector<std::pair<Active*, int>>& work, std::vector<SequenceChunk>& chunks,
                   std::vector<std::optional<RowChoice>>& choices) {
  if (work.empty()) return;
  try {
    executor_->begin_choices(chunks, choices);
  } catch (const std::exception& e) {
    // The step's sequences may be part-way through it.
    for (auto& [a, n] : work) finish(*a, Finish::error, e.what());
    return;
  }
  Flight next;
  for (auto& [a, n] : work) next.rows.push_back(a);
  if (flight_) {  // pipelined: the step before is read now
    metrics_.pipelined_steps++;
    Flight before = std::move(*flight_);
    flight_ = std::move(next);
    read(before);
  } else {
    flight_ = std::move(next);
  }
}

// Whether every running request is in the flight, with its next token to be picked from
// it, and still wanted: none cancelled or past its deadline.
bool Engine::continues() const {
  const auto now = Clock::now();
  if (running_.empty()) return false;
  for (const auto& a : running_) {
    if (a->done || !flight_->holds(a.get()) || a->handle->cancelled() || now > a->deadline) return false;
  }
  return true;
}

// The next decode step of the flight's requests, begun before the flight is read: each
// takes its token from its row of the flight (picked by the executor) and the draw after
// the one in flight. A request that the token in flight ends (max_tokens, the context)
// sits it out; one that it ends otherwise (EOS, a stop string) runs one token more, read
// and dropped. If that step's state does not fit, the flight is read instead and the
// next step admits, preempts and snapshots as usual.
void Engine::continue_flight() {
  std::vector<std::pair<Active*, int>> work;
  std::vector<SequenceChunk> chunks;
  std::vector<std::optional<RowChoice>> choices;
  const int64_t context = model_.config().max_position_embeddings;
  for (size_t i = 0; i < flight_->rows.size(); ++i) {
    Active* a = flight_->rows[i];
    if (a->done || a->generated + 1 >= a->request.max_tokens ||
        static_cast<int64_t>(a->tokens.size()) + 1 >= context) {
      continue;
    }
    work.emplace_back(a, 1);
    chunks.push_back({a->sequence.get(), {}, static_cast<int>(i)});
    choices.push_back(RowChoice{a->request.sampling, a->sampler.draws() + 1, std::max(1, a->request.top_logprobs)});
  }
  const auto growth = [&] {
    uint64_t bytes = 0;
    for (const auto& [a, n] : work) bytes += executor_->state_growth(a->sequence.get(), n);
    return bytes;
  };
  if (work.empty() || !make_room(growth)) {
    settle();
    update_stats();
    return;
  }
  metrics_.steps++;
  metrics_.batch_size.observe(static_cast<double>(work.size()));
  metrics_.step_tokens.observe(static_cast<double>(work.size()));
  begin(work, chunks, choices);
  update_stats();
}

void Engine::settle() {
  Flight flight = std::move(*flight_);
  flight_.reset();
  read(flight);
}

// Reads `flight`, the oldest begun call (Executor::finish_choices): each request's token
// sampled and emitted, snapshots of prompts that reached a block boundary kept. A call
// that fails ends its requests with the error.
void Engine::read(Flight& flight) {
  std::vector<std::optional<RowSummary>> rows;
  try {
    rows = executor_->finish_choices();
  } catch (const std::exception& e) {
    for (Active* a : flight.rows) finish(*a, Finish::error, e.what());
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    Active& a = *flight.rows[i];
    if (a.done) continue;  // ended meanwhile: its row is dropped
    remember_prefix(a);
    if (rows[i]) emit_token(a, a.sampler.next(*rows[i]), *rows[i]);
  }
  retire_done();
}

bool Engine::Flight::holds(const Active* a) const { return std::find(rows.begin(), rows.end(), a) != rows.end(); }

// Drops the requests that ended from the running batch; those the flight still runs are
// kept with it until it is read.
void Engine::retire_done() {
  for (auto& a : running_) {
    if (a->done && flight_ && flight_->holds(a.get())) flight_->ended.push_back(std::move(a));
  }
  std::erase_if(running_, [](const auto& a) { return !a || a->done; });
}

void Engine::release(Active& a) {
  if (flight_ && flight_->holds(&a)) {
    flight_->states.push_back(std::move(a.sequence));
  } else {
    a.sequence.reset();
  }
}

void Engine::update_stats() {
  retire_done();
  uint64_t running = 0;
  for (const auto& a : running_) running += a->sequence->bytes();
  state_bytes_ = running;
  state_in_use_ = executor_->state_in_use();
  running_count_ = running_.size();
  metrics_.prefix_queries = prefix_cache_.queries();
  metrics_.prefix_hits = prefix_cache_.hits();
  metrics_.prefix_hit_tokens = prefix_cache_.hit_tokens();
  metrics_.prefix_bytes = prefix_cache_.bytes();
}

void Engine::write_metrics(std::string& out) const {
  const EngineStats s = stats();
  write_counter(out, "keel_requests_submitted_total", "Requests accepted into the queue", metrics_.requests_submitted.load());
  write_counter(out, "keel_requests_rejected_total", "Requests refused because the queue was full", metrics_.requests_rejected.load());
  metrics_.finished.write(out, "keel_requests_finished_total", "reason", "Requests finished, by reason");
  write_counter(out, "keel_prompt_tokens_total", "Prompt tokens of admitted requests", metrics_.prompt_tokens.load());
  write_counter(out, "keel_generation_tokens_total", "Tokens generated", metrics_.generation_tokens.load());
  write_counter(out, "keel_prefix_cache_queries_total", "Prefix-cache lookups (one per admitted request)",
                metrics_.prefix_queries.load());
  write_counter(out, "keel_prefix_cache_hits_total", "Lookups that resumed from a cached prompt prefix",
                metrics_.prefix_hits.load());
  write_counter(out, "keel_prefix_cache_hit_tokens_total", "Prompt tokens not recomputed thanks to the prefix cache",
                metrics_.prefix_hit_tokens.load());
  write_gauge(out, "keel_prefix_cache_bytes", "Bytes of the state the prefix snapshots refer to (blocks they share counted in each)", static_cast<double>(metrics_.prefix_bytes.load()));
  write_counter(out, "keel_preemptions_total", "Requests preempted (state dropped, recomputed later)", metrics_.preemptions.load());
  write_counter(out, "keel_engine_steps_total", "Engine steps", metrics_.steps.load());
  write_counter(out, "keel_engine_pipelined_steps_total", "Engine steps begun before the step before was read",
                metrics_.pipelined_steps.load());
  write_gauge(out, "keel_queue_depth", "Requests waiting", static_cast<double>(s.queued));
  write_gauge(out, "keel_running_requests", "Requests in the running batch", static_cast<double>(s.running));
  write_gauge(out, "keel_state_bytes", "Sequence-state bytes of the running requests", static_cast<double>(s.state_bytes));
  write_gauge(out, "keel_state_in_use_bytes", "Sequence-state bytes in use: running requests and prefix snapshots",
              static_cast<double>(s.state_in_use));
  write_gauge(out, "keel_state_budget_bytes", "Sequence-state byte budget", static_cast<double>(limits_.state_bytes));
  write_gauge(out, "keel_state_usage_ratio", "Sequence-state bytes in use over the budget",
              static_cast<double>(s.state_in_use) / static_cast<double>(std::max<uint64_t>(1, limits_.state_bytes)));
  metrics_.ttft.write(out, "keel_time_to_first_token_seconds", "Time from submission to the first token");
  metrics_.tpot.write(out, "keel_time_per_output_token_seconds", "Time between consecutive tokens of a request");
  metrics_.e2e.write(out, "keel_e2e_request_latency_seconds", "Time from submission to the end");
  metrics_.batch_size.write(out, "keel_batch_size", "Requests forwarded per step");
  metrics_.step_tokens.write(out, "keel_step_tokens", "Tokens forwarded per step");
}

}  // namespace keel::serve
