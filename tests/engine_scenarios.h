// What the serving engine's tests share, on the CPU (tests/test_serve_engine.cpp) and on
// a GPU (tests/gpu/test_gpu_engine.cpp): the prompts, what one request received, and the
// pipelining scenario set against itself with steps read one by one.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/model.h"
#include "serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace keel::serve {

inline const std::vector<std::string> kPrompts = {
    "It was a fine morning, and Elizabeth",
    "The carriage stopped at the door of the house, and",
    "Mr. Darcy said nothing for a while.",
    "She could not help laughing at",
    "In the evening the whole party went",
    "Nothing could be more delightful than",
};

// What one request received.
struct Outcome {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string text;
  Finish finish = Finish::none;
  std::string error;
  int prompt_tokens = 0, completion_tokens = 0;

  Sink sink() {
    return [this](GenerationEvent&& ev) {
      std::lock_guard lock(mutex);
      if (ev.token) tokens.push_back(*ev.token);
      text += ev.text;
      if (ev.finish != Finish::none) {
        finish = ev.finish;
        error = ev.error;
        prompt_tokens = ev.prompt_tokens;
        completion_tokens = ev.completion_tokens;
        cv.notify_all();
      }
    };
  }
  void wait() {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return finish != Finish::none; }));
  }
  size_t token_count() {
    std::lock_guard lock(mutex);
    return tokens.size();
  }
};

// A stop string that a greedy continuation of kPrompts[0] meets part-way through its
// first 40 tokens, found by an engine with steps read one by one.
inline std::string pipelining_stop(const std::function<std::unique_ptr<Engine>(EngineLimits)>& make,
                                   const Tokenizer& tokenizer) {
  const auto engine = make({});
  Outcome out;
  EXPECT_TRUE(engine->submit({.prompt = tokenizer.encode(kPrompts[0], true), .max_tokens = 40, .ignore_eos = true},
                             out.sink()));
  out.wait();
  return out.text.substr(out.text.size() / 2, 3);
}

struct ScenarioRun {
  std::vector<std::unique_ptr<Outcome>> outcomes;
  EngineStats stats;
};

// Seven requests through an engine with EngineLimits::pipelined as given: greedy and
// whole-row sampled requests (pipelined), a top-k one among them for a while (its steps
// read at once), ends by max_tokens and by `stop` part-way through (and by EOS where the
// model emits it: not checked that it does), and a request submitted while the others
// decode (the begun step is read before it is admitted). Each request's outcome, and
// the engine's stats once its last state is freed (the engine thread frees it after the
// last event; a leak stays).
inline ScenarioRun run_pipelining_scenario(const std::function<std::unique_ptr<Engine>(EngineLimits)>& make,
                                           const Tokenizer& tokenizer, const std::string& stop, bool pipelined) {
  ScenarioRun r;
  const auto engine = make({.max_running = 8, .pipelined = pipelined});
  const auto submit = [&](GenerationRequest request) {
    r.outcomes.push_back(std::make_unique<Outcome>());
    EXPECT_TRUE(engine->submit(std::move(request), r.outcomes.back()->sink()));
  };
  const auto prompt = [&](const std::string& text) { return tokenizer.encode(text, true); };
  submit({.prompt = prompt(kPrompts[0]), .max_tokens = 40, .stop = {stop}});
  submit({.prompt = prompt(kPrompts[1]), .max_tokens = 33});
  submit({.prompt = prompt(kPrompts[2]), .max_tokens = 41, .sampling = {.temperature = 0.8f, .seed = 5}});
  submit({.prompt = prompt(kPrompts[3]), .max_tokens = 9, .sampling = {.temperature = 0.9f, .top_k = 20, .seed = 2}});
  submit({.prompt = prompt(kPrompts[4]), .max_tokens = 50, .ignore_eos = true});
  submit({.prompt = prompt(kPrompts[5]), .max_tokens = 50});
  while (r.outcomes[1]->token_count() < 12 && r.outcomes[1]->finish == Finish::none) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  submit({.prompt = prompt(kPrompts[2] + " " + kPrompts[4]), .max_tokens = 17,
          .sampling = {.temperature = 1.2f, .seed = 9}});
  for (auto& o : r.outcomes) o->wait();
  for (int i = 0; i < 5000 && engine->stats().state_in_use != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  r.stats = engine->stats();
  return r;
}

// The pipelined run gave every request what the waited one did, pipelining most of its
// steps and none of the waited run's, and freed every state (those that ran a step past
// their end too).
inline void expect_same_outcomes(const ScenarioRun& waited, const ScenarioRun& pipelined) {
  ASSERT_EQ(waited.outcomes.size(), pipelined.outcomes.size());
  for (size_t i = 0; i < waited.outcomes.size(); ++i) {
    const Outcome &w = *waited.outcomes[i], &p = *pipelined.outcomes[i];
    EXPECT_EQ(p.tokens, w.tokens) << "request " << i;
    EXPECT_EQ(p.text, w.text) << "request " << i;
    EXPECT_EQ(p.finish, w.finish) << "request " << i;
    EXPECT_EQ(p.completion_tokens, w.completion_tokens) << "request " << i;
    EXPECT_EQ(w.error, "") << "request " << i;
  }
  EXPECT_EQ(waited.outcomes[0]->finish, Finish::stop);
  EXPECT_EQ(waited.outcomes[4]->tokens.size(), 50u);
  EXPECT_EQ(waited.stats.pipelined_steps, 0u);
  EXPECT_GT(pipelined.stats.pipelined_steps, 20u);
  EXPECT_EQ(pipelined.stats.state_in_use, 0u);
}

}  // namespace keel::serve
