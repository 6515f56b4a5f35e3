// keel plan: resolve and print the kernel plan of a model (its config.json only, or a
// synth preset shape) for any architecture, or list the kernels this binary holds.
#include <cstdio>
#include <fmt/format.h>
#include <memory>

#include "cli/commands.h"
#include "cli/plan_command.h"
#include "plan/expert_split.h"
#include "synth/synth.h"
#ifdef KEEL_HAVE_CUDA
#include "cuda/device.h"
#endif

namespace keel::cli {
namespace {

WeightFormat parse_format(const std::string& text, const std::string& flag) {
  if (auto f = parse_weight_format(text)) return *f;
  std::string known;
  for (WeightFormat f : all_weight_formats()) known += (known.empty() ? "" : ", ") + std::string(name(f));
  fail(ErrorCode::usage, {.field = flag}, "unknown weight format '" + text + "' (one of " + known + ")");
}

struct PlanCommand {
  PlanOptions plan;
  std::string model, shape;
  int layers = 0, mtp_layers = -1;
  int gpus = 1, hosts = 1;
  bool json = false, per_layer = false, list_kernels = false;
};

void run_plan(const PlanCommand& o) {
  if (o.list_kernels) {
    const Registry& r = Registry::builtin();
    fmt::print("{}\n", o.json ? r.to_json() : r.table());
    return;
  }
  if (o.model.empty() == o.shape.empty()) fail(ErrorCode::usage, {}, "give exactly one of --model DIR and --shape NAME");
  const ModelConfig config = o.model.empty()
                                 ? synth_config({.shape = o.shape, .layers = o.layers, .mtp_layers = o.mtp_layers})
                                 : load_config(o.model);
  std::string source;
  const Arch arch = plan_arch(o.plan, &source);
  const Plan plan = make_plan(config, o.plan, arch);
  if (o.json) {
    fmt::print("{}\n", plan.to_json());
  } else {
    fmt::print("arch {} ({})\n{}", name(arch), source, plan.table(o.per_layer));
  }
  if (o.gpus * o.hosts > 1 && !o.json) fmt::print("{}", ExpertSplit{o.gpus * o.hosts, o.hosts}.describe(config));
}

}  // namespace

void add_plan_options(CLI::App* cmd, PlanOptions& o) {
  cmd->add_option("--arch", o.arch, "Plan for this architecture: " + arch_names() + " (default: the GPU found, else cpu)");
  for (Backend b : all_backends()) {
    std::string ops;
    for (Op op : ops_of(b)) ops += (ops.empty() ? "" : ", ") + std::string(name(op));
    cmd->add_option(flag(b, ModelRole::target), o.target[b], "Kernel for " + ops + ": auto or a name from --list-kernels");
    cmd->add_option(flag(b, ModelRole::draft), o.draft[b], "The same for the draft (MTP) layers (default: as the target)");
  }
  cmd->add_option("--expert-format", o.expert_format, "Plan as if the routed experts were stored in this format");
  cmd->add_option("--draft-expert-format", o.draft_expert_format,
                  "Plan as if the MTP layers' routed experts were stored in this format");
}

Arch plan_arch(const PlanOptions& o, std::string* source) {
  const auto said = [&](const std::string& why) {
    if (source) *source = why;
  };
  if (!o.arch.empty()) {
    said("--arch");
    return parse_arch_or_fail(o.arch, "--arch");
  }
#ifdef KEEL_HAVE_CUDA
  const auto devices = cuda::devices();
  if (!devices.empty()) {
    const cuda::DeviceInfo& d = devices.front();
    const auto arch = arch_of_capability(d.major, d.minor);
    if (!arch) {
      fail(ErrorCode::usage, {.field = "--arch"},
           fmt::format("GPU 0 ({}) has compute capability {}.{}, which keel has no kernels for; give --arch ({})", d.name,
                       d.major, d.minor, arch_names()));
    }
    said(fmt::format("GPU 0: {}", d.name));
    return *arch;
  }
  said("no GPU found");
#else
  said("this build has no CUDA");
#endif
  return Arch::cpu;
}

Plan make_plan(const ModelConfig& config, const PlanOptions& o, Arch arch) {
  ModelConfig c = config;
  if (!o.expert_format.empty()) c.expert_format = parse_format(o.expert_format, "--expert-format");
  PlanRequest request{.config = c, .arch = arch, .target = o.target, .draft = o.draft};
  if (!o.draft_expert_format.empty())
    request.draft_expert_format = parse_format(o.draft_expert_format, "--draft-expert-format");
  return resolve_plan(request);
}

void add_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Print the kernel plan of a model for an architecture (no GPU needed)");
  auto o = std::make_shared<PlanCommand>();
  std::string shapes;
  for (const auto& s : synth_shapes()) shapes += (shapes.empty() ? "" : "|") + s;
  cmd->add_option("--model", o->model, "Model directory (only config.json is read)");
  cmd->add_option("--shape", o->shape, "Or a synth preset shape instead of a directory: " + shapes);
  cmd->add_option("--layers", o->layers, "With --shape: trunk layers (default: the preset's)");
  cmd->add_option("--mtp-layers", o->mtp_layers, "With --shape: MTP layers (default 1)");
  add_plan_options(cmd, o->plan);
  cmd->add_option("--gpus", o->gpus, "Also show the expert-parallel split over this many GPUs")->check(CLI::Range(1, 64));
  cmd->add_option("--hosts", o->hosts, "... of each of this many hosts (as keel run --hosts)")->check(CLI::Range(1, 1024));
  cmd->add_flag("--json", o->json, "JSON instead of a table");
  cmd->add_flag("--per-layer", o->per_layer, "One table row per layer and op (default: alike layers grouped)");
  cmd->add_flag("--list-kernels", o->list_kernels, "List the kernels in this binary instead");
  cmd->callback([o] { run_plan(*o); });
}

}  // namespace keel::cli
