// keel logits: logits of a token sequence as .npy, for parity checks against other
// implementations: one full forward, or token by token through the incremental state.
#include <fmt/format.h>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/load_model.h"
#include "io/npy.h"

namespace keel::cli {

void add_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Write the logits of a token sequence as float32 .npy [tokens, vocab]");
  struct Options {
    std::string model, ids, out;
    bool decode = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "Model directory")->required();
  cmd->add_option("--ids", o->ids, "Token ids: .npy (int32/int64, 1-D) or a text file of integers")->required();
  cmd->add_option("--out", o->out, "Output .npy file")->required();
  cmd->add_flag("--decode", o->decode, "Feed the tokens one at a time through the incremental state");
  cmd->callback([o] {
    const std::vector<int32_t> ids = read_ids(o->ids);
    if (ids.empty()) fail(ErrorCode::bad_input, {.file = o->ids}, "no token ids in the file");
    const auto model = load_model(o->model, /*quiet=*/true);
    Sequence seq = model->new_sequence();
    std::vector<float> logits;
    if (o->decode) {
      for (size_t i = 0; i < ids.size(); ++i) {
        const auto row = model->forward(seq, std::span(ids).subspan(i, 1));
        logits.insert(logits.end(), row.begin(), row.end());
      }
    } else {
      logits = model->forward(seq, ids);
    }
    const int64_t vocab = model->config().vocab_size;
    write_npy_f32(o->out, logits, {static_cast<int64_t>(ids.size()), vocab});
    fmt::print("wrote {}: [{}, {}] float32\n", o->out, ids.size(), vocab);
  });
}

}  // namespace keel::cli
