// Prometheus text exposition for the server: counters, gauges and histograms, all named
// keel_*. Thread-safe: the engine thread records, the HTTP thread renders.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace keel::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // # HELP / # TYPE lines, then _bucket{le=..}, _sum and _count.
  void write(std::string& out, std::string_view name, std::string_view help) const;

 private:
  mutable std::mutex mutex_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Counters with one label (e.g. finish reason, HTTP status).
class LabeledCounter {
 public:
  void add(const std::string& label, uint64_t n = 1);
  uint64_t get(const std::string& label) const;
  void write(std::string& out, std::string_view name, std::string_view label_name, std::string_view help) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> values_;
};

void write_counter(std::string& out, std::string_view name, std::string_view help, double value);
void write_gauge(std::string& out, std::string_view name, std::string_view help, double value);

struct EngineMetrics {
  std::atomic<uint64_t> requests_submitted{0}, requests_rejected{0}, prompt_tokens{0},
      generation_tokens{0}, preemptions{0}, steps{0}, pipelined_steps{0};
  // The prefix cache's counters, copied from the engine thread after each step.
  std::atomic<uint64_t> prefix_queries{0}, prefix_hits{0}, prefix_hit_tokens{0}, prefix_bytes{0};
  LabeledCounter finished;  // by finish reason
  Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram tpot{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
  Histogram e2e{{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}};
  Histogram batch_size{{1, 2, 4, 8, 16, 32, 64, 128, 256}};
  Histogram step_tokens{{1, 4, 16, 64, 256, 1024, 4096}};
};

}  // namespace keel::serve
