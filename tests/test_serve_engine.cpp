// The serving engine without HTTP, on the demo model: outputs against a plain loop over
// Model::forward and Sampler (what `keel run` does), alone and in busy batches, with
// chunked prefill, preemption, stop strings, cancellation, queue limits, timeouts and
// pipelined steps.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/error.h"
#include "engine_scenarios.h"
#include "model/model.h"
#include "ops/sampling.h"
#include "serve/engine.h"
#include "testing.h"
#include "tokenizer/tokenizer.h"

namespace keel::serve {
namespace {

const std::string kModel = std::string(KEEL_SOURCE_DIR) + "/models/keel-tiny-v4";

struct Demo {
  std::unique_ptr<Model> model = Model::load(kModel);
  Tokenizer tokenizer = Tokenizer::from_model_dir(kModel);
};

const Demo& demo() {
  static const Demo d;
  return d;
}

// The reference: a plain loop over the whole prompt, then one token at a time.
std::vector<int32_t> reference(const std::vector<int32_t>& prompt, int max_tokens, SamplingParams sampling = {},
                               bool ignore_eos = false) {
  const Model& m = *demo().model;
  Sequence seq = m.new_sequence();
  Sampler sampler(sampling);
  std::vector<int32_t> out;
  std::vector<float> logits = m.forward(seq, prompt, LogitRows::last);
  while (true) {
    const int32_t t = sampler.next(logits);
    out.push_back(t);
    if ((!ignore_eos && t == m.config().eos_token_id) || static_cast<int>(out.size()) == max_tokens) break;
    logits = m.forward(seq, std::span(&t, 1), LogitRows::last);
  }
  return out;
}

std::vector<int32_t> prompt_of(const std::string& text) { return demo().tokenizer.encode(text, true); }


TEST(ServeEngine, GreedyEqualsPlainLoop) {
  Engine engine(*demo().model, demo().tokenizer);
  const auto prompt = prompt_of(kPrompts[0]);
  Outcome out;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 40}, out.sink()));
  out.wait();
  const auto expected = reference(prompt, 40);
  EXPECT_EQ(out.tokens, expected);
  EXPECT_EQ(out.text, demo().tokenizer.decode(std::vector<int32_t>(expected.begin(), expected.end() - (expected.back() == 1))));
  EXPECT_EQ(out.prompt_tokens, static_cast<int>(prompt.size()));
  EXPECT_EQ(out.completion_tokens, static_cast<int>(expected.size()));
  EXPECT_EQ(out.finish, expected.size() == 40 ? Finish::length : Finish::stop);
}

TEST(ServeEngine, SeededSamplingEqualsPlainLoop) {
  Engine engine(*demo().model, demo().tokenizer);
  const SamplingParams sampling{.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 1234};
  const auto prompt = prompt_of(kPrompts[1]);
  Outcome a, b;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 30, .sampling = sampling}, a.sink()));
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 30, .sampling = sampling}, b.sink()));
  a.wait();
  b.wait();
  EXPECT_EQ(a.tokens, reference(prompt, 30, sampling));
  EXPECT_EQ(a.tokens, b.tokens);
}

// Batch invariance: a greedy request gives the same tokens alone and among many others
// (sampled and greedy, of different lengths), with small prefill chunks and step budget.
TEST(ServeEngine, GreedyOutputIsTheSameAloneAndInABusyBatch) {
  const auto prompt = prompt_of(kPrompts[2]);
  std::vector<int32_t> alone;
  {
    Engine engine(*demo().model, demo().tokenizer);
    Outcome out;
    ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 48, .ignore_eos = true}, out.sink()));
    out.wait();
    alone = out.tokens;
  }
  Engine engine(*demo().model, demo().tokenizer, {.max_running = 8, .step_tokens = 24, .prefill_chunk = 5});
  std::vector<std::unique_ptr<Outcome>> others;
  for (int i = 0; i < 12; ++i) {
    others.push_back(std::make_unique<Outcome>());
    std::string text = kPrompts[i % kPrompts.size()];
    for (int r = 0; r < i; ++r) text += " and then " + kPrompts[(i + r) % kPrompts.size()];
    ASSERT_TRUE(engine.submit({.prompt = prompt_of(text), .max_tokens = 20 + 3 * i,
                               .sampling = {.temperature = i % 2 ? 0.8f : 0.0f, .seed = uint64_t(i)}},
                              others.back()->sink()));
    if (i == 5) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Outcome busy;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 48, .ignore_eos = true}, busy.sink()));
  busy.wait();
  for (auto& o : others) o->wait();
  EXPECT_EQ(busy.tokens, alone);
  EXPECT_EQ(alone, reference(prompt, 48, {}, true));
}

TEST(ServeEngine, ChunkedPrefillOfALongPromptEqualsPlainLoop) {
  std::string text;
  for (int i = 0; i < 12; ++i) text += kPrompts[i % kPrompts.size()] + " ";
  const auto prompt = prompt_of(text);
  ASSERT_GT(prompt.size(), 100u);
  Engine engine(*demo().model, demo().tokenizer, {.step_tokens = 9, .prefill_chunk = 7});
  Outcome out;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 24}, out.sink()));
  out.wait();
  EXPECT_EQ(out.tokens, reference(prompt, 24));
}

// The most state a request of `tokens` tokens (run one at a time) holds before a step,
// with what that step may take: the budget one such request needs.
uint64_t peak_state_bytes(int tokens) {
  const Model& m = *demo().model;
  auto pool = std::make_shared<HostBlockPool>(m.state_block_floats());
  Sequence probe = m.new_sequence(pool);
  int64_t peak = 0;
  for (int t = 0; t < tokens; ++t) {
    peak = std::max(peak, pool->used() + m.blocks_needed(probe, 1));
    const int32_t id = 100;
    m.forward(probe, std::span(&id, 1), LogitRows::last);
  }
  return static_cast<uint64_t>(peak) * pool->block_bytes();
}

// A state budget of 1.6 requests at their largest: requests admitted beside others grow
// past it, the newest are preempted and recomputed, and every request still produces
// exactly the plain loop's tokens.
TEST(ServeEngine, PreemptedRequestsRecomputeTheSameTokens) {
  const Model& m = *demo().model;
  const uint64_t budget = peak_state_bytes(80) * 8 / 5;
  Engine engine(m, demo().tokenizer, {.max_running = 8, .prefill_chunk = 16, .state_bytes = budget});
  std::vector<std::unique_ptr<Outcome>> outs;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt_of(kPrompts[i]));
    outs.push_back(std::make_unique<Outcome>());
    ASSERT_TRUE(engine.submit({.prompt = prompts.back(), .max_tokens = 60, .sampling = {.temperature = 0.7f, .seed = uint64_t(7 + i)}, .ignore_eos = true},
                              outs.back()->sink()));
  }
  for (auto& o : outs) o->wait();
  std::string metrics;
  engine.write_metrics(metrics);
  const auto at = metrics.find("\nkeel_preemptions_total ");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GT(std::stod(metrics.substr(at + 24)), 0) << metrics;
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(outs[i]->finish, Finish::length);
    EXPECT_EQ(outs[i]->tokens, reference(prompts[i], 60, {.temperature = 0.7f, .seed = uint64_t(7 + i)}, true)) << i;
  }
  EXPECT_EQ(engine.stats().state_bytes, 0u);
}

// One number of the engine's Prometheus text.
double metric(const Engine& engine, const std::string& name) {
  std::string text;
  engine.write_metrics(text);
  const auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

// Prefix caching: a request whose prompt starts with an earlier prompt resumes from that
// prompt's last cached block (ring, open compressor windows, entries and indexer keys
// restored) and still gives the plain loop's tokens; so does a repeat of the prompt.
TEST(ServeEngine, PrefixCacheResumesExactly) {
  std::string text;
  for (int i = 0; i < 12; ++i) text += kPrompts[i % kPrompts.size()] + " ";
  const auto first = prompt_of(text);
  ASSERT_GT(first.size(), 100u);  // the cached prefix is past the 64-token window
  std::vector<int32_t> longer = first;
  for (const int32_t id : demo().tokenizer.encode(" and so the story went on.", false)) longer.push_back(id);
  Engine engine(*demo().model, demo().tokenizer, {.prefill_chunk = 24, .prefix_block = 16});
  Outcome a, b, c;
  ASSERT_TRUE(engine.submit({.prompt = first, .max_tokens = 8}, a.sink()));
  a.wait();
  EXPECT_EQ(metric(engine, "keel_prefix_cache_hits_total"), 0);
  ASSERT_TRUE(engine.submit({.prompt = longer, .max_tokens = 24}, b.sink()));
  b.wait();
  const int64_t cached = static_cast<int64_t>((first.size() - 1) / 16 * 16);  // the last block inside `first`
  EXPECT_EQ(metric(engine, "keel_prefix_cache_hits_total"), 1);
  EXPECT_EQ(metric(engine, "keel_prefix_cache_hit_tokens_total"), cached);
  EXPECT_EQ(b.tokens, reference(longer, 24));
  ASSERT_TRUE(engine.submit({.prompt = first, .max_tokens = 8}, c.sink()));
  c.wait();
  EXPECT_EQ(metric(engine, "keel_prefix_cache_hits_total"), 2);
  EXPECT_EQ(c.tokens, a.tokens);
  EXPECT_EQ(a.tokens, reference(first, 8));
  EXPECT_GT(metric(engine, "keel_prefix_cache_bytes"), 0);
  EXPECT_EQ(metric(engine, "keel_prefix_cache_queries_total"), 3);
}

// A budget too small for any snapshot caches nothing, and changes no output.
TEST(ServeEngine, PrefixCacheWithoutRoomCachesNothing) {
  const auto prompt = prompt_of(kPrompts[0] + " " + kPrompts[1] + " " + kPrompts[2]);
  Engine engine(*demo().model, demo().tokenizer, {.prefix_cache_bytes = 1, .prefix_block = 8});
  for (int i = 0; i < 2; ++i) {
    Outcome out;
    ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 12}, out.sink()));
    out.wait();
    EXPECT_EQ(out.tokens, reference(prompt, 12));
  }
  EXPECT_EQ(metric(engine, "keel_prefix_cache_hits_total"), 0);
  EXPECT_EQ(metric(engine, "keel_prefix_cache_bytes"), 0);
}

// On the CPU a snapshot shares the request's state blocks: the state in use (snapshots
// and all) is less than what the snapshots refer to one by one, and no running request
// holds any once they finished.
TEST(ServeEngine, PrefixSnapshotsShareStateBlocks) {
  std::string text;
  for (int i = 0; i < 6; ++i) text += kPrompts[i % kPrompts.size()] + " ";
  const auto prompt = prompt_of(text);
  ASSERT_GT(prompt.size(), 48u);
  Engine engine(*demo().model, demo().tokenizer, {.prefill_chunk = 24, .prefix_block = 16});
  Outcome out;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 4}, out.sink()));
  out.wait();
  // The last token reaches the sink before the engine retires the request.
  for (int i = 0; i < 100 && engine.stats().running != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const double in_use = metric(engine, "keel_state_in_use_bytes"), cached = metric(engine, "keel_prefix_cache_bytes");
  EXPECT_GT(in_use, 0);
  EXPECT_LT(in_use, cached);
  EXPECT_EQ(metric(engine, "keel_state_bytes"), 0);
}

// Snapshots live in the same budget as the running requests and give way to them: with
// room for about one and a half requests, requests one after another evict snapshots
// rather than preempt anyone, and give the plain loop's tokens.
TEST(ServeEngine, SnapshotsGiveWayToRunningRequests) {
  const Model& m = *demo().model;
  Sequence probe = m.new_sequence();
  std::vector<int32_t> ids(120, 100);
  m.forward(probe, ids, LogitRows::last);
  const uint64_t budget = probe.state_bytes() * 3 / 2;
  Engine engine(m, demo().tokenizer,
                {.prefill_chunk = 16, .state_bytes = budget, .prefix_cache_bytes = budget * 8, .prefix_block = 16});
  for (int i = 0; i < 4; ++i) {
    std::string text;
    for (int j = 0; j < 4; ++j) text += kPrompts[(i + j) % kPrompts.size()] + " ";
    const auto prompt = prompt_of(text);
    Outcome out;
    ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 16, .ignore_eos = true}, out.sink()));
    out.wait();
    EXPECT_EQ(out.finish, Finish::length) << out.error;
    EXPECT_EQ(out.tokens, reference(prompt, 16, {}, true)) << i;
    EXPECT_LE(metric(engine, "keel_state_in_use_bytes"), static_cast<double>(budget));
  }
  EXPECT_EQ(metric(engine, "keel_preemptions_total"), 0);
}

// A request that does not fit beside the running ones waits: it is not admitted and
// preempted again step after step (its first chunk alone may fit the budget, but not
// the step). Budgets from a little over one request's state to two; every request
// gives the plain loop's tokens.
TEST(ServeEngine, WaitingRequestIsNotPreemptedStepAfterStep) {
  const Model& m = *demo().model;
  const double per_request = static_cast<double>(peak_state_bytes(112));
  for (const double share : {1.1, 1.3, 1.6, 1.9}) {
    Engine engine(m, demo().tokenizer,
                  {.prefill_chunk = 16, .state_bytes = static_cast<uint64_t>(per_request * share), .prefix_cache_bytes = 0});
    const auto first = prompt_of(kPrompts[0] + " " + kPrompts[1]), second = prompt_of(kPrompts[2] + " " + kPrompts[3]);
    Outcome a, b;
    ASSERT_TRUE(engine.submit({.prompt = first, .max_tokens = 48, .ignore_eos = true}, a.sink()));
    for (int i = 0; i < 2000 && a.token_count() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_TRUE(engine.submit({.prompt = second, .max_tokens = 48, .ignore_eos = true}, b.sink()));
    a.wait();
    b.wait();
    EXPECT_EQ(a.tokens, reference(first, 48, {}, true)) << share << " " << a.error << " prompt " << first.size();
    EXPECT_EQ(b.tokens, reference(second, 48, {}, true)) << share << " " << b.error << " prompt " << second.size();
    EXPECT_LE(engine.stats().preemptions, 1u) << "budget " << share << " requests";
  }
}

// Waiting requests are admitted by priority (lower first), arrivals in order within one.
// The order in which requests finish, by name: wraps an Outcome's sink.
class FinishOrder {
 public:
  auto named(Outcome& out, std::string name) {
    return [this, &out, name, inner = out.sink()](GenerationEvent&& ev) mutable {
      if (ev.finish != Finish::none) {
        std::lock_guard lock(mutex_);
        finished_.push_back(name);
      }
      inner(std::move(ev));
    };
  }
  std::vector<std::string> finished() {
    std::lock_guard lock(mutex_);
    return finished_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> finished_;
};

TEST(ServeEngine, QueueAdmitsByPriority) {
  Engine engine(*demo().model, demo().tokenizer, {.max_running = 1});
  FinishOrder order;
  const auto prompt = prompt_of(kPrompts[0]);
  Outcome running, low, high, normal;
  // The running request outranks every waiting one, so none preempts it.
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 30, .ignore_eos = true, .priority = -5},
                            order.named(running, "running")));
  while (running.token_count() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 4, .ignore_eos = true, .priority = 5}, order.named(low, "low")));
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 4, .ignore_eos = true}, order.named(normal, "normal")));
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 4, .ignore_eos = true, .priority = -3}, order.named(high, "high")));
  for (Outcome* o : {&running, &low, &high, &normal}) o->wait();
  EXPECT_EQ(order.finished(), (std::vector<std::string>{"running", "high", "normal", "low"}));
  EXPECT_EQ(low.tokens, high.tokens);  // priority changes when, not what
}

// With no room left, a waiting request of higher priority preempts the running one of
// lower priority, which later finishes with exactly the tokens it would have made alone.
TEST(ServeEngine, HighPriorityPreemptsARunningLowerOne) {
  Engine engine(*demo().model, demo().tokenizer, {.max_running = 1});
  FinishOrder order;
  const auto prompt = prompt_of(kPrompts[0]);
  Outcome low, high;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 40, .ignore_eos = true, .priority = 2}, order.named(low, "low")));
  while (low.token_count() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 4, .ignore_eos = true, .priority = -1}, order.named(high, "high")));
  for (Outcome* o : {&low, &high}) o->wait();
  EXPECT_EQ(order.finished(), (std::vector<std::string>{"high", "low"}));
  EXPECT_GE(engine.stats().preemptions, 1u);
  EXPECT_EQ(low.tokens, reference(prompt, 40, {}, /*ignore_eos=*/true));
}

TEST(ServeEngine, StopStringEndsTheTextBeforeIt) {
  const auto prompt = prompt_of(kPrompts[0]);
  const auto tokens = reference(prompt, 40);
  const std::string full = demo().tokenizer.decode(tokens);
  ASSERT_GT(full.size(), 20u);
  const std::string stop = full.substr(full.size() / 2, 3);
  const std::string expected = full.substr(0, full.find(stop));
  Engine engine(*demo().model, demo().tokenizer);
  Outcome out;
  ASSERT_TRUE(engine.submit({.prompt = prompt, .max_tokens = 40, .stop = {"never appears", stop}}, out.sink()));
  out.wait();
  EXPECT_EQ(out.finish, Finish::stop);
  EXPECT_EQ(out.text, expected);
  EXPECT_LT(out.tokens.size(), tokens.size());
}

// Pipelined steps give every request the same tokens, text and ending as steps read one
// by one (tests/engine_scenarios.h), on the CPU.
TEST(ServeEngine, PipelinedStepsGiveTheSameTokensAsStepsReadOneByOne) {
  const auto engine = [](EngineLimits limits) {
    return std::make_unique<Engine>(*demo().model, demo().tokenizer, limits);
  };
  const std::string stop = pipelining_stop(engine, demo().tokenizer);
  const ScenarioRun waited = run_pipelining_scenario(engine, demo().tokenizer, stop, false);
  const ScenarioRun pipelined = run_pipelining_scenario(engine, demo().tokenizer, stop, true);
  expect_same_outcomes(waited, pipelined);
  EXPECT_EQ(waited.outcomes[1]->tokens, reference(prompt_of(kPrompts[1]), 33));
}

TEST(ServeEngine, CancelledRequestStopsAndFreesItsState) {
  Engine engine(*demo().model, demo().tokenizer);
  Outcome out;
  auto handle = engine.submit({.prompt = prompt_of(kPrompts[3]), .max_tokens = 3000, .ignore_eos = true}, out.sink());
  ASSERT_TRUE(handle);
  while (out.token_count() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(engine.stats().running, 1u);
  EXPECT_GT(engine.stats().state_bytes, 0u);
  handle->cancel();
  out.wait();
  EXPECT_EQ(out.finish, Finish::cancelled);
  EXPECT_LT(out.tokens.size(), 3000u);
  for (int i = 0; i < 100 && engine.stats().running != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(engine.stats().running, 0u);
  EXPECT_EQ(engine.stats().state_bytes, 0u);
}

TEST(ServeEngine, FullQueueRefusesAndTimeoutEnds) {
  Engine engine(*demo().model, demo().tokenizer, {.max_running = 1, .max_queued = 1, .timeout = std::chrono::milliseconds(1500)});
  Outcome a, b;
  auto ha = engine.submit({.prompt = prompt_of(kPrompts[4]), .max_tokens = 3000, .ignore_eos = true}, a.sink());
  ASSERT_TRUE(ha);
  while (a.token_count() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(engine.submit({.prompt = prompt_of(kPrompts[5]), .max_tokens = 4}, b.sink()));
  Outcome c;
  EXPECT_EQ(engine.submit({.prompt = prompt_of(kPrompts[5]), .max_tokens = 4}, c.sink()), nullptr);
  a.wait();
  EXPECT_EQ(a.finish, Finish::timeout);
  b.wait();
  EXPECT_NE(b.finish, Finish::error);
}

TEST(ServeEngine, BadRequestsThrow) {
  Engine engine(*demo().model, demo().tokenizer);
  Outcome out;
  KEEL_EXPECT_ERROR(engine.submit({.prompt = {}}, out.sink()), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(engine.submit({.prompt = {5, 99999}}, out.sink()), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(engine.submit({.prompt = {5}, .max_tokens = 0}, out.sink()), ErrorCode::bad_input);
  KEEL_EXPECT_ERROR(engine.submit({.prompt = std::vector<int32_t>(4096, 5)}, out.sink()), ErrorCode::bad_input);
  EXPECT_THROW(engine.submit({.prompt = {5}, .sampling = {.temperature = -1}}, out.sink()), Error);
}

}  // namespace
}  // namespace keel::serve
