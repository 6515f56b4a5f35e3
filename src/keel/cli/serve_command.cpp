// keel serve: the OpenAI-compatible server (docs/serve.md). With no arguments it serves
// the demo model on http://127.0.0.1:8000.
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <unistd.h>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/runner.h"
#include "serve/engine.h"
#include "serve/http_server.h"
#include "tokenizer/tokenizer.h"

namespace keel::cli {
namespace {

namespace fs = std::filesystem;

struct ServeOptions {
  std::string model, served_name;
  serve::ServerOptions server;
  serve::EngineLimits limits;
  uint64_t state_mb = 1024;
  bool state_mb_given = false;
  double memory_fraction = 0.9;
  uint64_t prefix_cache_mb = 256;
  double timeout_s = 600;
  bool quiet = false;
  KernelOptions kernels;
};

// The demo model: models/keel-tiny-v4 under the working directory, else beside the
// build tree that holds this binary.
std::string default_model() {
  const fs::path here = "models/keel-tiny-v4";
  if (fs::exists(here / "config.json")) return here.string();
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
      if (fs::exists(dir / here / "config.json")) return (dir / here).string();
    }
  }
  return here.string();
}

// Room the forward pass's intermediate buffers may take at the largest step: the
// launched steps' workspace, and on one GPU the decode graphs' own (up to 256 rows).
constexpr uint64_t kWorkspaceReserve = uint64_t{3} << 30;

// On a GPU the sequence state (running requests and prefix snapshots) may take
// `fraction` of the device's memory, less what is in use now (weights and all) and room
// for the workspace.
uint64_t gpu_state_budget(const Executor::Memory& memory, double fraction) {
  if (!(fraction > 0 && fraction <= 1)) fail(ErrorCode::usage, {.field = "--memory-fraction"}, "must be in (0, 1]");
  const double allowed = fraction * static_cast<double>(memory.total) - static_cast<double>(memory.total - memory.free);
  const double left = allowed - static_cast<double>(kWorkspaceReserve);
  if (left < double{1 << 20}) {
    fail(ErrorCode::usage, {.field = "--memory-fraction"},
         fmt::format("{} of the device's {:.0f} MiB leaves no room for sequence state: {:.0f} MiB are in use and the "
                     "workspace takes {:.0f} MiB",
                     fraction, memory.total / 1048576.0, (memory.total - memory.free) / 1048576.0,
                     kWorkspaceReserve / 1048576.0));
  }
  return static_cast<uint64_t>(left);
}

void serve_main(ServeOptions& o) {
  if (o.model.empty()) o.model = default_model();
  if (!fs::exists(fs::path(o.model) / "tokenizer.json")) {
    fail(ErrorCode::usage, {.file = o.model + "/tokenizer.json"}, "keel serve needs a model with a tokenizer");
  }
  if (o.served_name.empty()) o.served_name = fs::path(o.model).lexically_normal().filename().string();
  if (o.served_name.empty()) o.served_name = fs::path(o.model).lexically_normal().parent_path().filename().string();
  if (o.timeout_s <= 0) fail(ErrorCode::usage, {.field = "--timeout"}, "must be > 0");
  o.limits.state_bytes = o.state_mb << 20;
  o.limits.prefix_cache_bytes = o.prefix_cache_mb << 20;
  o.limits.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));

  const Tokenizer tokenizer = Tokenizer::from_model_dir(o.model);
  const Loaded loaded = load_executor(o.model, o.quiet, o.kernels);
  const Model& model = *loaded.model;
  if (const auto memory = loaded.executor->device_memory(); memory && !o.state_mb_given) {
    o.limits.state_bytes = gpu_state_budget(*memory, o.memory_fraction);
    if (!o.quiet) {
      fmt::print("sequence-state budget {:.0f} MiB ({:.0f}% of {:.0f} MiB of device memory, less what is in use and "
                 "{} MiB of workspace)\n",
                 o.limits.state_bytes / 1048576.0, 100 * o.memory_fraction, memory->total / 1048576.0,
                 kWorkspaceReserve >> 20);
    }
  }
  auto engine = std::make_unique<serve::Engine>(model, *loaded.executor, tokenizer, o.limits);
  const serve::ServedModel served{.id = o.served_name, .model = model, .tokenizer = tokenizer};
  serve::HttpServer server(*engine, served, o.server);
  fmt::print("serving {} as '{}'\nlistening on http://{}:{}\n", o.model, o.served_name, o.server.host, server.port());
  std::fflush(stdout);
  server.run();
  engine.reset();  // requests still running end (cancelled) before the server goes
  fmt::print(stderr, "keel serve: stopped\n");
}

}  // namespace

void add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (CPU or GPUs)");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("--model", o->model, "Model directory (default: the demo model, models/keel-tiny-v4)");
  cmd->add_option("--served-model-name", o->served_name, "The model's name in the API (default: the directory's name)");
  cmd->add_option("--host", o->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o->server.port, "Port (0: any free port; the bound one is printed)")->capture_default_str();
  cmd->add_option("--api-key", o->server.api_key, "Require Authorization: Bearer KEY on /v1/*");
  cmd->add_option("--max-body-bytes", o->server.max_body_bytes, "Largest request body (413 past it)")->capture_default_str();
  cmd->add_option("--max-running", o->limits.max_running, "Requests in the running batch at most")->capture_default_str();
  cmd->add_option("--max-queued", o->limits.max_queued, "Waiting requests at most (503 past it)")->capture_default_str();
  cmd->add_option("--step-tokens", o->limits.step_tokens, "Tokens forwarded per engine step, all requests together")->capture_default_str();
  cmd->add_option("--prefill-chunk", o->limits.prefill_chunk, "Prompt tokens one request forwards per step")->capture_default_str();
  cmd->add_option("--state-mb", o->state_mb,
                  "Sequence-state budget in MiB: running requests and prefix snapshots (on the CPU, the capacity of "
                  "the paged state pool). Snapshots are evicted first, then the lowest-priority, newest request is "
                  "preempted; on a GPU the default comes from --memory-fraction")
      ->capture_default_str()
      ->each([o](const std::string&) { o->state_mb_given = true; });
  cmd->add_option("--memory-fraction", o->memory_fraction,
                  "GPU: the share of device memory keel may use, weights included; sequence state gets what is left")
      ->capture_default_str();
  cmd->add_option("--prefix-cache-mb", o->prefix_cache_mb, "State the prompt-prefix snapshots may refer to, MiB, within the state budget (0: no prefix cache)")
      ->capture_default_str();
  cmd->add_option("--prefix-block", o->limits.prefix_block, "Prompt prefixes are cached at multiples of this")
      ->capture_default_str();
  cmd->add_option("--timeout", o->timeout_s, "Per-request timeout in seconds")->capture_default_str();
  cmd->add_flag("--pipeline,!--no-pipeline", o->limits.pipelined,
                "Begin a decode step whose tokens the device can pick (greedy or whole-row sampling) before the step "
                "before is read (vLLM's async scheduling; the same tokens). On by default; --no-pipeline reads each "
                "step before the next begins");
  cmd->add_flag("--quiet,-q", o->quiet, "No loading progress");
  add_kernel_options(cmd, o->kernels);
  cmd->callback([o] { serve_main(*o); });
}

}  // namespace keel::cli
