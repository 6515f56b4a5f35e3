// keel bench: prefill and decode speed of a model on the CPU or a GPU, next to the
// device's memory bandwidth measured in the same run (decode reads every active weight
// once per token, so bandwidth is its roofline).
#include <algorithm>
#include <chrono>
#include <map>
#include <fmt/format.h>
#include <numeric>
#include <random>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/runner.h"
#include "model/speculative.h"
#include "ops/sampling.h"

namespace keel::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Decodes `steps` tokens after `prompt` with the stage timer on; one row per stage, most
// time first.
void print_stages(const std::map<std::string, double>& stages, int steps, const std::string& title,
                  const std::string& per);

void print_profile(Runner& runner, std::span<const int32_t> prompt, int steps) {
  runner.reset();
  Sampler greedy({});
  runner.executor().set_profiling(true);
  int32_t next = runner.next(prompt, greedy);
  print_stages(runner.executor().profile(), 1, fmt::format("prefill of {} tokens: time by stage", prompt.size()),
               "call");
  runner.executor().set_profiling(false);
  runner.executor().set_profiling(true);
  for (int i = 0; i < steps; ++i) next = runner.next(std::span(&next, 1), greedy);
  const auto stages = runner.executor().profile();
  runner.executor().set_profiling(false);
  print_stages(stages, steps, "decode time by stage", "token");
}

// One row per stage of `stages` (seconds over `steps` steps), most time first.
void print_stages(const std::map<std::string, double>& stages, int steps, const std::string& title,
                  const std::string& per) {
  if (stages.empty()) return;
  std::vector<std::pair<double, std::string>> rows, host;  // host: the "host: ..." entries, apart
  double total = 0;
  for (const auto& [stage, s] : stages) {
    if (stage.starts_with("host: ")) {
      host.emplace_back(s, stage);
      continue;
    }
    rows.emplace_back(s, stage);
    total += s;
  }
  std::sort(rows.rbegin(), rows.rend());
  fmt::print("{} ({} steps, all layers; CUDA events per stage):\n", title, steps);
  for (const auto& [s, stage] : rows) {
    fmt::print("  {:<48} {:8.3f} ms/{} {:5.1f}%\n", stage, s * 1e3 / steps, per, 100 * s / total);
  }
  for (const auto& [s, stage] : host) fmt::print("  {:<48} {:8.3f} ms/{}\n", stage, s * 1e3 / steps, per);
}

// Decode speed of `batch` sequences at once: each gets its own random prompt (prefilled
// in batched calls of at most kPrefillRows rows), then every step is one batched call
// with one token per sequence. The best of `runs`.
struct BatchedDecode {
  int batch = 0, prompt = 0, steps = 0;
  double step_seconds = 0;         // pipelined steps (timed_decode)
  double waited_step_seconds = 0;  // each step's tokens back before the next
  double comm_seconds = 0;  // per step, several GPUs: the MoE all-reduces
  double tokens_per_second() const { return batch / step_seconds; }
};

// One batched call choosing each chunk's next token greedily, as the engine's step does
// (on a GPU only the rows' sampling summaries come back).
std::vector<int32_t> greedy_step(Executor& executor, std::span<const SequenceChunk> chunks) {
  const std::vector<std::optional<RowChoice>> choices(chunks.size(), RowChoice{});
  std::vector<int32_t> next;
  for (const auto& row : executor.forward_choices(chunks, choices)) next.push_back(choose({}, 0, *row));
  return next;
}

// Seconds for `steps` greedy decode steps of `sequences`, one batched call a step, the
// first running `first` (a token each). Pipelined, each step's tokens are picked on the
// device from the step before's summaries and the host reads them a step late
// (Executor::begin_choices); waited, each step's tokens come back before the next step
// is enqueued.
double timed_decode(Executor& executor, std::span<SequenceState* const> sequences, std::span<const int32_t> first,
                    int steps, bool pipelined) {
  const size_t n = sequences.size();
  const std::vector<std::optional<RowChoice>> choices(n, RowChoice{});
  std::vector<int32_t> next(first.begin(), first.end());
  std::vector<SequenceChunk> chunks(n);
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    for (size_t i = 0; i < n; ++i) {
      const bool picked = pipelined && step > 0;
      chunks[i] = {sequences[i], picked ? std::span<const int32_t>{} : std::span(&next[i], 1), picked ? static_cast<int>(i) : -1};
    }
    if (!pipelined) {
      next = greedy_step(executor, chunks);
      continue;
    }
    executor.begin_choices(chunks, choices);
    if (step > 0) executor.finish_choices();  // the step before's summaries (its tokens are on the device)
  }
  if (pipelined) executor.finish_choices();
  return seconds_since(start);
}

BatchedDecode batched_decode(Executor& executor, const ModelConfig& c, int batch, int prompt, int steps, int runs,
                             bool profile) {
  if (batch < 1 || prompt < 1 || steps < 1) {
    fail(ErrorCode::usage, {.field = "--batch"}, "batch sizes, --batch-prompt and --decode must be positive");
  }
  constexpr int kPrefillRows = 2048;
  std::mt19937 rng(2);
  std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(prompt));
  for (auto& p : prompts) {
    for (auto& id : p) id = static_cast<int32_t>(rng() % c.vocab_size);
  }
  BatchedDecode result{batch, prompt, steps, 1e30, 1e30};
  // Each run decodes pipelined, then waited, each on fresh sequences.
  for (int r = 0; r < 2 * runs + (profile ? 1 : 0); ++r) {
    const bool profiled = r == 2 * runs, pipelined = r % 2 == 0 && !profiled;  // profiled: an extra run, not timed
    std::vector<std::unique_ptr<SequenceState>> sequences;
    std::vector<SequenceState*> held;
    std::vector<int32_t> next(batch);
    for (int first = 0; first < batch;) {
      const int count = std::max(1, std::min(batch - first, kPrefillRows / prompt));
      std::vector<SequenceChunk> chunks;
      for (int i = first; i < first + count; ++i) {
        sequences.push_back(executor.new_sequence());
        held.push_back(sequences.back().get());
        chunks.push_back({sequences.back().get(), prompts[i]});
      }
      const std::vector<int32_t> chosen = greedy_step(executor, chunks);
      std::copy(chosen.begin(), chosen.end(), next.begin() + first);
      first += count;
    }
    executor.set_profiling(profiled);
    executor.reset_communication();
    const double s = timed_decode(executor, held, next, steps, pipelined) / steps;
    if (profiled) {
      print_stages(executor.profile(), steps, fmt::format("batch of {}: decode step time by stage", batch), "step");
      executor.set_profiling(false);
    } else if (!pipelined) {
      result.waited_step_seconds = std::min(result.waited_step_seconds, s);
    } else if (s < result.step_seconds) {
      result.step_seconds = s;
      result.comm_seconds = executor.communication_seconds() / steps;
    }
  }
  return result;
}

// Greedy decoding of `tokens` after `prompt` with `drafts` MTP drafts per step, the best
// of `runs`: tokens/s and the acceptance of the best run.
struct SpeculativeRun {
  int drafts = 0;
  double tokens_per_second = 0;
  SpeculativeDecoder::Stats stats;
};

SpeculativeRun speculative_decode(Executor& executor, std::span<const int32_t> prompt, int drafts, int tokens, int runs) {
  SpeculativeRun best{drafts};
  for (int r = 0; r < runs; ++r) {
    const std::unique_ptr<SpeculativeTarget> target = executor.speculative_target();
    SpeculativeDecoder spec(*target, drafts);
    Sampler greedy({});
    spec.start(prompt, greedy);
    const auto start = std::chrono::steady_clock::now();
    while (spec.stats().tokens < tokens) spec.step(greedy);
    const double tps = static_cast<double>(spec.stats().tokens) / seconds_since(start);
    if (tps > best.tokens_per_second) best = {drafts, tps, spec.stats()};
  }
  return best;
}

}  // namespace

void add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Prefill and decode tokens/s on the CPU or a GPU, against measured memory bandwidth");
  struct Options {
    std::string model;
    int prompt = 256, decode = 64, runs = 3, batch_prompt = 32;
    std::vector<int> batches, prefill_lengths, speculative;
    int prefill_chunk = 4096;
    uint64_t bandwidth_mib = 2048;
    bool json = false, profile = false;
    KernelOptions kernels;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "Model directory (required unless `keel bench serve`)");
  add_bench_serve(*cmd);
  cmd->add_option("--prompt", o->prompt, "Prefill tokens (one call)")->capture_default_str();
  cmd->add_option("--decode", o->decode, "Decode steps after the prefill")->capture_default_str();
  cmd->add_option("--runs", o->runs, "Repetitions; the best is reported")->capture_default_str();
  cmd->add_option("--bandwidth-mib", o->bandwidth_mib, "Buffer for the bandwidth measurement")->capture_default_str();
  cmd->add_option("--batch", o->batches,
                  "Also decode this many sequences at once (comma-separated sizes), each step one batched call")
      ->delimiter(',');
  cmd->add_option("--prefill-lengths", o->prefill_lengths,
                  "Also prefill prompts of these lengths (comma-separated), in calls of --prefill-chunk tokens")
      ->delimiter(',');
  cmd->add_option("--prefill-chunk", o->prefill_chunk, "Tokens per call in the --prefill-lengths runs")
      ->capture_default_str();
  cmd->add_option("--batch-prompt", o->batch_prompt, "Prompt tokens of each sequence in the batched runs")
      ->capture_default_str();
  cmd->add_option("--speculative", o->speculative,
                  "Also decode with this many MTP drafts per step (comma-separated, 1..3): tok/s and acceptance")
      ->delimiter(',');
  cmd->add_flag("--json", o->json, "One JSON object instead of the table");
  cmd->add_flag("--profile", o->profile, "GPU: after the timed runs, prefill and decode again and print the time per stage of each");
  add_kernel_options(cmd, o->kernels);
  add_host_options(cmd, o->kernels);
  cmd->callback([o, cmd] {
    if (cmd->got_subcommand("serve")) return;
    if (o->model.empty()) fail(ErrorCode::usage, {.field = "--model"}, "keel bench needs --model DIR");
    const Loaded loaded = load_executor(o->model, o->json, o->kernels);
    const Model& model = *loaded.model;
    Runner runner(*loaded.executor);
    const ModelConfig& c = model.config();
    std::mt19937 rng(1);
    std::vector<int32_t> prompt(o->prompt);
    for (auto& id : prompt) id = static_cast<int32_t>(rng() % c.vocab_size);

    // Each run prefills and decodes pipelined, then again decoding waited (timed_decode).
    double prefill_s = 1e30, decode_s = 1e30, waited_decode_s = 1e30, decode_comm_s = 0;
    for (int r = 0; r < 2 * o->runs; ++r) {
      const bool pipelined = r % 2 == 0;
      runner.reset();
      Sampler greedy({});
      const auto start = std::chrono::steady_clock::now();
      const int32_t next = runner.next(prompt, greedy);
      prefill_s = std::min(prefill_s, seconds_since(start));
      runner.executor().reset_communication();
      SequenceState* sequence = &runner.sequence();
      const double s = timed_decode(runner.executor(), std::span(&sequence, 1), std::span(&next, 1), o->decode, pipelined);
      if (!pipelined) {
        waited_decode_s = std::min(waited_decode_s, s);
      } else if (s < decode_s) {
        decode_s = s;
        decode_comm_s = runner.executor().communication_seconds();
      }
    }
    std::vector<BatchedDecode> batched;
    for (int b : o->batches) {
      batched.push_back(batched_decode(runner.executor(), c, b, o->batch_prompt, o->decode, o->runs, o->profile));
    }
    std::vector<SpeculativeRun> speculative;
    for (int k : o->speculative) {
      speculative.push_back(speculative_decode(runner.executor(), prompt, k, o->decode, o->runs));
    }
    std::vector<std::pair<int, double>> prefills;  // (length, seconds)
    for (int length : o->prefill_lengths) {
      if (length < 1 || o->prefill_chunk < 1) {
        fail(ErrorCode::usage, {.field = "--prefill-lengths"}, "prefill lengths and --prefill-chunk must be positive");
      }
      std::vector<int32_t> long_prompt(length);
      for (auto& id : long_prompt) id = static_cast<int32_t>(rng() % c.vocab_size);
      double best = 1e30;
      for (int r = 0; r < o->runs; ++r) {
        runner.reset();
        const auto start = std::chrono::steady_clock::now();
        // As the engine runs a long prompt: chunks without logits, the last one choosing.
        Sampler greedy({});
        for (int done = 0; done < length; done += o->prefill_chunk) {
          const auto chunk = std::span(long_prompt).subspan(done, std::min(o->prefill_chunk, length - done));
          if (done + o->prefill_chunk < length) runner.prefill(chunk);
          else runner.next(chunk, greedy);
        }
        best = std::min(best, seconds_since(start));
      }
      prefills.emplace_back(length, best);
    }
    const double tensor = prefills.empty() ? 0 : runner.executor().measure_tensor_throughput();
    const double flops_per_token = 2.0 * static_cast<double>(model.linear_macs_per_token());
    const double bandwidth = runner.executor().measure_bandwidth(o->bandwidth_mib << 20);
    // Several GPUs: one all-reduce of [1, hidden] per MoE layer per decode step.
    const double comm_per_step = decode_comm_s / o->decode;
    const double comm_floor = runner.executor().all_reduce_floor(c.hidden_size) * c.num_hidden_layers;
    const double prefill_tps = o->prompt / prefill_s, decode_tps = o->decode / decode_s;
    const double waited_decode_tps = o->decode / waited_decode_s;
    const double bytes = static_cast<double>(model.decode_bytes_per_token());
    const double achieved = bytes * decode_tps;
    if (o->json) {
      std::string batched_json, prefill_json, speculative_json;
      for (const SpeculativeRun& r : speculative) {
        speculative_json += fmt::format(
            "{}{{\"drafts\": {}, \"tok_s\": {:.2f}, \"drafted\": {}, \"accepted\": {}, \"trunk_forwards\": {}}}",
            speculative_json.empty() ? "" : ", ", r.drafts, r.tokens_per_second, r.stats.drafted, r.stats.accepted,
            r.stats.steps);
      }
      for (const auto& [length, seconds] : prefills) {
        prefill_json += fmt::format("{}{{\"tokens\": {}, \"tok_s\": {:.2f}, \"linear_tflops\": {:.3f}}}",
                                    prefill_json.empty() ? "" : ", ", length, length / seconds,
                                    length / seconds * flops_per_token / 1e12);
      }
      for (const BatchedDecode& b : batched) {
        batched_json += fmt::format(
            "{}{{\"batch\": {}, \"prompt_tokens\": {}, \"tok_s\": {:.2f}, \"step_ms\": {:.4f}, "
            "\"waited_step_ms\": {:.4f}, \"comm_ms\": {:.4f}}}",
            batched_json.empty() ? "" : ", ", b.batch, b.prompt, b.tokens_per_second(), b.step_seconds * 1e3,
            b.waited_step_seconds * 1e3, b.comm_seconds * 1e3);
      }
      fmt::print(
          "{{\"device\": \"{}\", \"prompt_tokens\": {}, \"prefill_tok_s\": {:.2f}, \"decode_tokens\": {}, "
          "\"decode_tok_s\": {:.2f}, \"decode_waited_tok_s\": {:.2f}, \"decode_weight_bytes\": {}, \"decode_gb_s\": {:.3f}, "
          "\"memory_read_gb_s\": {:.3f}, \"bandwidth_share\": {:.4f}, \"decode_comm_ms\": {:.4f}, "
          "\"decode_comm_floor_ms\": {:.4f}, \"batched\": [{}], \"prefill\": [{}], \"speculative\": [{}]}}\n",
          runner.executor().device(), o->prompt, prefill_tps, o->decode, decode_tps, waited_decode_tps, bytes,
          achieved / 1e9, bandwidth / 1e9,
          achieved / bandwidth, comm_per_step * 1e3, comm_floor * 1e3, batched_json, prefill_json, speculative_json);
      return;
    }
    fmt::print("device                  {}\n", runner.executor().device());
    fmt::print("prefill                 {:.1f} tok/s ({} tokens, one call)\n", prefill_tps, o->prompt);
    fmt::print("decode                  {:.2f} tok/s = {:.3f} ms/token ({} steps after the prompt, pipelined: each "
               "enqueued before the token of the one before is back)\n",
               decode_tps, 1e3 / decode_tps, o->decode);
    fmt::print("decode, steps waited    {:.2f} tok/s = {:.3f} ms/token (each step's token back before the next)\n",
               waited_decode_tps, 1e3 / waited_decode_tps);
    fmt::print("decode weight bytes     {:.1f} MiB per token\n", bytes / 1048576.0);
    fmt::print("decode weight traffic   {:.2f} GB/s\n", achieved / 1e9);
    fmt::print("memory bandwidth        {:.2f} GB/s (measured now, {} MiB buffer; GPU: copy, read + write)\n",
               bandwidth / 1e9, o->bandwidth_mib);
    fmt::print("share of bandwidth      {:.1f}%\n", 100.0 * achieved / bandwidth);
    {
      // The context that fits: what is free on the device after the weights, over the
      // state a token adds (the per-sequence part counted once).
      const double per_token = model.state_bytes_per_token();
      const uint64_t per_sequence = model.state_bytes_per_sequence();
      std::string fits;
      if (const auto memory = runner.executor().device_memory(); memory && per_token > 0) {
        const double room = static_cast<double>(memory->free) - static_cast<double>(per_sequence);
        fits = fmt::format("; {:.0f}K tokens fit in the {:.1f} GiB free now", std::max(0.0, room) / per_token / 1024,
                           memory->free / 1073741824.0);
      }
      fmt::print("sequence state          {:.1f} bytes per token (compressed entries, indexer keys; f32) + {:.2f} MiB per "
                 "sequence at most (rings, open windows){}\n",
                 per_token, per_sequence / 1048576.0, fits);
    }
    for (const auto& [length, seconds] : prefills) {
      const double tflops = length / seconds * flops_per_token / 1e12;
      const std::string share =
          tensor > 0 ? fmt::format(" = {:.1f}% of {:.1f} TFLOP/s bf16 mma.sync measured now",
                                   100 * tflops * 1e12 / tensor, tensor / 1e12)
                     : "";
      fmt::print("prefill {:>6} tokens    {:.1f} tok/s; linear layers {:.1f} TFLOP/s{}\n", length, length / seconds,
                 tflops, share);
    }
    for (const BatchedDecode& b : batched) {
      const std::string comm = b.comm_seconds > 0 ? fmt::format("; all-reduces {:.3f} ms = {:.1f}% of the step",
                                                                b.comm_seconds * 1e3, 100 * b.comm_seconds / b.step_seconds)
                                                  : "";
      fmt::print("batched decode {:>4}     {:.1f} tok/s = {:.3f} ms per step ({} steps, pipelined; {:.3f} ms waited; "
                 "{}-token prompts{})\n",
                 b.batch, b.tokens_per_second(), b.step_seconds * 1e3, b.steps, b.waited_step_seconds * 1e3, b.prompt,
                 comm);
    }
    for (const SpeculativeRun& r : speculative) {
      fmt::print("speculative decode {}    {:.2f} tok/s = {:.2f}x plain decode; {:.1f}% of drafts accepted, {:.2f} tokens "
                 "per trunk forward\n",
                 r.drafts, r.tokens_per_second, r.tokens_per_second / decode_tps, 100.0 * r.stats.accepted / std::max<int64_t>(1, r.stats.drafted),
                 static_cast<double>(r.stats.tokens) / std::max<int64_t>(1, r.stats.steps));
    }
    if (const std::string graphs = runner.executor().decode_graphs(); !graphs.empty()) {
      fmt::print("decode graphs           {}\n", graphs);
    }
    if (o->profile) print_profile(runner, prompt, o->decode);
    if (comm_floor > 0) {
      fmt::print("decode communication    {:.3f} ms per step = {:.1f}% of the step; floor {:.3f} ms ({} all-reduces of "
                 "{} floats, measured now)\n",
                 comm_per_step * 1e3, 100.0 * comm_per_step * decode_tps, comm_floor * 1e3, c.num_hidden_layers,
                 c.hidden_size);
    }
  });
}

}  // namespace keel::cli
