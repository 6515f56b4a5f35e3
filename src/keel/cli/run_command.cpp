// keel run: generate from a prompt on the CPU or a GPU, streaming text (or ids, for a model
// without a tokenizer) to stdout, speed to stderr at the end.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <optional>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/runner.h"
#include "io/npy.h"
#include "model/speculative.h"
#include "ops/sampling.h"
#include "tokenizer/tokenizer.h"

namespace keel::cli {
namespace {

struct RunOptions {
  std::string model, prompt, prompt_ids;
  int max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false, quiet = false;
  int speculative = 0;  // MTP draft tokens per step (0: off)
  bool text_given = false, ids_given = false;
  KernelOptions kernels;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::string item;
  const auto flush = [&] {
    if (item.empty()) return;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < INT32_MIN || v > INT32_MAX) {
      fail(ErrorCode::bad_input, {.field = "--prompt-ids"}, "'" + item + "' is not a token id");
    }
    ids.push_back(static_cast<int32_t>(v));
    item.clear();
  };
  for (char ch : text) {
    if (ch == ',' || std::isspace(static_cast<unsigned char>(ch))) {
      flush();
    } else {
      item += ch;
    }
  }
  flush();
  return ids;
}

// Streams generated text, holding back a tail that could still become a stop string.
class TextOut {
 public:
  explicit TextOut(const std::vector<std::string>& stop) : stop_(stop) {}
  // Returns true when a stop string completed (the text before it is printed).
  bool add(const std::string& piece) {
    pending_ += piece;
    for (const auto& s : stop_) {
      if (const auto at = pending_.find(s); !s.empty() && at != std::string::npos) {
        emit(pending_.substr(0, at));
        pending_.clear();
        return true;
      }
    }
    size_t keep = 0;  // the longest suffix that is a proper prefix of a stop string
    for (const auto& s : stop_) {
      for (size_t n = std::min(s.size() - 1, pending_.size()); n > keep; --n) {
        if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
          keep = n;
          break;
        }
      }
    }
    emit(pending_.substr(0, pending_.size() - keep));
    pending_.erase(0, pending_.size() - keep);
    return false;
  }
  void finish() {
    emit(pending_);
    pending_.clear();
  }

 private:
  static void emit(const std::string& s) {
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  }
  const std::vector<std::string>& stop_;
  std::string pending_;
};

void run(const RunOptions& o) {
  if (o.text_given == o.ids_given) fail(ErrorCode::usage, {}, "give exactly one of --prompt TEXT and --prompt-ids IDS");
  if (o.text_given && o.prompt.empty()) fail(ErrorCode::bad_input, {.field = "--prompt"}, "the prompt is empty");
  if (o.max_tokens < 1) fail(ErrorCode::usage, {.field = "--max-tokens"}, "must be >= 1");
  Sampler sampler(o.sampling);
  std::optional<Tokenizer> tokenizer;
  if (std::filesystem::exists(o.model + "/tokenizer.json")) tokenizer = Tokenizer::from_model_dir(o.model);
  std::vector<int32_t> prompt;
  if (o.text_given) {
    if (!tokenizer) {
      fail(ErrorCode::usage, {.file = o.model + "/tokenizer.json"}, "this model has no tokenizer; use --prompt-ids");
    }
    prompt = tokenizer->encode(o.prompt, /*add_special_tokens=*/true);
  } else {
    prompt = parse_ids(o.prompt_ids);
  }
  if (!o.stop.empty() && !tokenizer) fail(ErrorCode::usage, {.field = "--stop"}, "stop strings need a tokenizer");

  const Loaded loaded = load_executor(o.model, o.quiet, o.kernels);
  const ModelConfig& c = loaded.model->config();
  Runner runner(*loaded.executor);
  // Tokens come in groups: one per step, or with speculative decoding the step's kept
  // drafts and the trunk's next token (the same tokens, fewer trunk forwards).
  std::unique_ptr<SpeculativeTarget> target;
  std::optional<SpeculativeDecoder> speculative;
  std::vector<int32_t> ready;
  const auto t0 = std::chrono::steady_clock::now();
  if (o.speculative > 0) {
    target = loaded.executor->speculative_target();
    speculative.emplace(*target, o.speculative);
    ready = {speculative->start(prompt, sampler)};
  } else {
    ready = {runner.next(prompt, sampler)};
  }
  const auto t1 = std::chrono::steady_clock::now();
  size_t at = 0;
  const auto length = [&] { return target ? target->length() : runner.length(); };
  const auto take = [&] {
    if (at == ready.size()) {
      ready = speculative ? speculative->step(sampler) : std::vector{runner.next(std::span(&ready.back(), 1), sampler)};
      at = 0;
    }
    return ready[at++];
  };

  std::optional<StreamDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer);
  TextOut text(o.stop);
  int generated = 0;
  std::string why = "max tokens";
  while (true) {
    const int32_t next = take();
    ++generated;
    if (!o.ignore_eos && next == c.eos_token_id) {
      why = "end of sequence";
      break;
    }
    if (decoder) {
      if (text.add(decoder->push(next))) {
        why = "stop string";
        break;
      }
    } else {
      fmt::print("{} ", next);
      std::fflush(stdout);
    }
    if (generated == o.max_tokens) break;
    if (length() + static_cast<int64_t>(ready.size() - at) >= c.max_position_embeddings) {
      why = "context full";
      break;
    }
  }
  if (decoder && why != "stop string") text.add(decoder->flush());
  text.finish();
  const auto t2 = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  fmt::print(stderr, "\n[prompt {} tokens, {:.1f} tok/s | generated {} tokens, {:.2f} tok/s | stopped: {}]\n",
             prompt.size(), prompt.size() / prefill_s, generated, generated / decode_s, why);
  if (speculative) {
    const auto& s = speculative->stats();
    fmt::print(stderr, "[speculative: {} drafts per step, {} of {} drafts accepted ({:.1f}%), {:.2f} tokens per trunk forward]\n",
               o.speculative, s.accepted, s.drafted, 100.0 * s.accepted / std::max<int64_t>(1, s.drafted),
               static_cast<double>(s.tokens) / std::max<int64_t>(1, s.steps));
  }
}

}  // namespace

void add_run(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "Generate from a prompt");
  auto o = std::make_shared<RunOptions>();
  cmd->add_option("--model", o->model, "Model directory")->required();
  cmd->add_option("--prompt", o->prompt, "Prompt text (tokenized with the model's tokenizer, BOS added)");
  cmd->add_option("--prompt-ids", o->prompt_ids, "Prompt token ids, separated by commas or spaces");
  cmd->add_option("--max-tokens,-n", o->max_tokens, "Tokens to generate at most")->capture_default_str();
  cmd->add_option("--temperature", o->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", o->sampling.top_k, "Keep the k most likely (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", o->sampling.top_p, "Nucleus mass (1 = off)")->capture_default_str();
  cmd->add_option("--min-p", o->sampling.min_p, "Drop tokens below min_p x the top probability")->capture_default_str();
  cmd->add_option("--seed", o->sampling.seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--stop", o->stop, "Stop when this text appears (repeatable)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "Keep going past the end-of-sequence token");
  cmd->add_option("--speculative", o->speculative,
                  "Draft tokens per step from the model's MTP layer (0 = off, 1..3; same output, fewer trunk forwards)")
      ->capture_default_str();
  cmd->add_flag("--quiet,-q", o->quiet, "No loading progress");
  add_kernel_options(cmd, o->kernels);
  add_host_options(cmd, o->kernels);
  cmd->callback([o, cmd] {
    o->text_given = cmd->count("--prompt") > 0;
    o->ids_given = cmd->count("--prompt-ids") > 0;
    run(*o);
  });
}

}  // namespace keel::cli
