#include "serve/metrics.h"

#include <algorithm>
#include <fmt/format.h>

namespace keel::serve {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  std::lock_guard lock(mutex_);
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::write(std::string& out, std::string_view name, std::string_view help) const {
  std::lock_guard lock(mutex_);
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    fmt::format_to(std::back_inserter(out), "{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  cumulative += counts_.back();
  fmt::format_to(std::back_inserter(out), "{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name,
                 cumulative, name, sum_, name, count_);
}

void LabeledCounter::add(const std::string& label, uint64_t n) {
  std::lock_guard lock(mutex_);
  values_[label] += n;
}

uint64_t LabeledCounter::get(const std::string& label) const {
  std::lock_guard lock(mutex_);
  const auto it = values_.find(label);
  return it == values_.end() ? 0 : it->second;
}

void LabeledCounter::write(std::string& out, std::string_view name, std::string_view label_name,
                           std::string_view help) const {
  std::lock_guard lock(mutex_);
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} counter\n", name, help, name);
  for (const auto& [label, value] : values_) {
    fmt::format_to(std::back_inserter(out), "{}{{{}=\"{}\"}} {}\n", name, label_name, label, value);
  }
}

void write_counter(std::string& out, std::string_view name, std::string_view help, double value) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, value);
}

void write_gauge(std::string& out, std::string_view name, std::string_view help, double value) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, value);
}

}  // namespace keel::serve
