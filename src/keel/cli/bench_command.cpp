// keel bench: prefill and decode speed of a model on the CPU, next to this machine's
// memory bandwidth measured in the same run (decode reads every active weight once per
// token, so bandwidth is its roofline).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <fmt/format.h>
#include <numeric>
#include <random>

#include "cli/commands.h"
#include "cli/load_model.h"
#include "ops/sampling.h"

namespace keel::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Read bandwidth over a buffer far larger than the caches, all threads, best of `runs`.
double read_bandwidth(size_t bytes, int runs) {
  std::vector<uint64_t> buffer(bytes / sizeof(uint64_t));
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = i;  // first touch by the reading thread
  double best = 0;
  for (int r = 0; r < runs; ++r) {
    const auto start = std::chrono::steady_clock::now();
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (size_t i = 0; i < buffer.size(); ++i) sum += buffer[i];
    const double s = seconds_since(start);
    if (sum == 42) fmt::print("");  // keeps the loop
    best = std::max(best, bytes / s);
  }
  return best;
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Prefill and decode tokens/s on the CPU, against measured memory bandwidth");
  struct Options {
    std::string model;
    int prompt = 256, decode = 64, runs = 3;
    uint64_t bandwidth_mib = 2048;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "Model directory")->required();
  cmd->add_option("--prompt", o->prompt, "Prefill tokens (one call)")->capture_default_str();
  cmd->add_option("--decode", o->decode, "Decode steps after the prefill")->capture_default_str();
  cmd->add_option("--runs", o->runs, "Repetitions; the best is reported")->capture_default_str();
  cmd->add_option("--bandwidth-mib", o->bandwidth_mib, "Buffer for the bandwidth measurement")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object instead of the table");
  cmd->callback([o] {
    const auto model = load_model(o->model, o->json);
    const ModelConfig& c = model->config();
    std::mt19937 rng(1);
    std::vector<int32_t> prompt(o->prompt);
    for (auto& id : prompt) id = static_cast<int32_t>(rng() % c.vocab_size);

    double prefill_s = 1e30, decode_s = 1e30;
    for (int r = 0; r < o->runs; ++r) {
      Sequence seq = model->new_sequence();
      auto start = std::chrono::steady_clock::now();
      auto logits = model->forward(seq, prompt, LogitRows::last);
      prefill_s = std::min(prefill_s, seconds_since(start));
      start = std::chrono::steady_clock::now();
      for (int i = 0; i < o->decode; ++i) {
        const int32_t next = argmax(logits);
        logits = model->forward(seq, std::span(&next, 1));
      }
      decode_s = std::min(decode_s, seconds_since(start));
    }
    const double bandwidth = read_bandwidth(o->bandwidth_mib << 20, 5);
    const double prefill_tps = o->prompt / prefill_s, decode_tps = o->decode / decode_s;
    const double bytes = static_cast<double>(model->decode_bytes_per_token());
    const double achieved = bytes * decode_tps;
    if (o->json) {
      fmt::print(
          "{{\"threads\": {}, \"prompt_tokens\": {}, \"prefill_tok_s\": {:.2f}, \"decode_tokens\": {}, "
          "\"decode_tok_s\": {:.2f}, \"decode_weight_bytes\": {}, \"decode_gb_s\": {:.3f}, "
          "\"memory_read_gb_s\": {:.3f}, \"bandwidth_share\": {:.4f}}}\n",
          omp_get_max_threads(), o->prompt, prefill_tps, o->decode, decode_tps, bytes, achieved / 1e9, bandwidth / 1e9,
          achieved / bandwidth);
      return;
    }
    fmt::print("threads                 {}\n", omp_get_max_threads());
    fmt::print("prefill                 {:.1f} tok/s ({} tokens, one call)\n", prefill_tps, o->prompt);
    fmt::print("decode                  {:.2f} tok/s ({} steps after the prompt)\n", decode_tps, o->decode);
    fmt::print("decode weight bytes     {:.1f} MiB per token\n", bytes / 1048576.0);
    fmt::print("decode weight traffic   {:.2f} GB/s\n", achieved / 1e9);
    fmt::print("memory read bandwidth   {:.2f} GB/s (measured now, {} MiB buffer)\n", bandwidth / 1e9, o->bandwidth_mib);
    fmt::print("share of bandwidth      {:.1f}%\n", 100.0 * achieved / bandwidth);
  });
}

}  // namespace keel::cli
