// keel logits: logits of a token sequence as .npy, for parity checks against other
// implementations: one full forward, or token by token through the incremental state.
#include <fmt/format.h>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/runner.h"
#include "io/npy.h"

namespace keel::cli {

void add_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Write the logits of a token sequence as float32 .npy [tokens, vocab]");
  struct Options {
    std::string model, ids, out;
    bool decode = false;
    KernelOptions kernels;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "Model directory")->required();
  cmd->add_option("--ids", o->ids, "Token ids: .npy (int32/int64, 1-D) or a text file of integers")->required();
  cmd->add_option("--out", o->out, "Output .npy file")->required();
  cmd->add_flag("--decode", o->decode, "Feed the tokens one at a time through the incremental state");
  cmd->add_option("--device", o->kernels.device, "Where the model runs: cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--gpus", o->kernels.gpus, "Split the model over GPUs 0..N-1 (expert parallel)")
      ->check(CLI::Range(1, 64));
  add_host_options(cmd, o->kernels);
  cmd->callback([o] {
    const std::vector<int32_t> ids = read_ids(o->ids);
    if (ids.empty()) fail(ErrorCode::bad_input, {.file = o->ids}, "no token ids in the file");
    const Loaded loaded = load_executor(o->model, /*quiet=*/true, o->kernels);
    Runner runner(*loaded.executor);
    std::vector<float> logits;
    if (o->decode) {
      for (size_t i = 0; i < ids.size(); ++i) {
        const auto row = runner.forward(std::span(ids).subspan(i, 1));
        logits.insert(logits.end(), row.begin(), row.end());
      }
    } else {
      logits = runner.forward(ids);
    }
    const int64_t vocab = loaded.model->config().vocab_size;
    write_npy_f32(o->out, logits, {static_cast<int64_t>(ids.size()), vocab});
    fmt::print("wrote {}: [{}, {}] float32\n", o->out, ids.size(), vocab);
  });
}

}  // namespace keel::cli
