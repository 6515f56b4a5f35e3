// The serving engine on a GPU executor (cuda/gpu_executor.h), on the demo model: its
// pipelined steps (EngineLimits::pipelined: each decode step begun before the step
// before is read, its tokens picked on the device) against steps read one by one.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "cuda/device.h"
#include "cuda/gpu_executor.h"
#include "cuda/gpu_model.h"
#include "engine_scenarios.h"
#include "model/model.h"
#include "serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace keel::serve {
namespace {

// The demo model in the checkout (scripts/gpu-check sets KEEL_SOURCE_DIR for a binary
// built in another).
std::string demo_dir() {
  const char* root = std::getenv("KEEL_SOURCE_DIR");
  return std::string(root ? root : KEEL_SOURCE_DIR) + "/models/keel-tiny-v4";
}

TEST(GpuEngine, PipelinedStepsGiveTheSameTokensAsStepsReadOneByOne) {
  if (cuda::devices().empty()) GTEST_SKIP() << "no CUDA device";
  const auto host = Model::load(demo_dir());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(demo_dir());
  const cuda::GpuExecutor executor(cuda::GpuModel::create(*host), 0, "test");
  const auto engine = [&](EngineLimits limits) { return std::make_unique<Engine>(*host, executor, tokenizer, limits); };
  const std::string stop = pipelining_stop(engine, tokenizer);
  const ScenarioRun waited = run_pipelining_scenario(engine, tokenizer, stop, false);
  const ScenarioRun pipelined = run_pipelining_scenario(engine, tokenizer, stop, true);
  expect_same_outcomes(waited, pipelined);
}

}  // namespace
}  // namespace keel::serve
