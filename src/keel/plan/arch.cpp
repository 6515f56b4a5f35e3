#include "plan/arch.h"

#include <array>

#include "base/error.h"

namespace keel {
namespace {

struct ArchRow {
  Arch arch;
  const char* name;
  int major, minor;  // compute capability; -1 for the CPU
};
constexpr std::array kArchs = {
    ArchRow{Arch::cpu, "cpu", -1, -1},        ArchRow{Arch::sm_80, "sm_80", 8, 0},
    ArchRow{Arch::sm_86, "sm_86", 8, 6},      ArchRow{Arch::sm_89, "sm_89", 8, 9},
    ArchRow{Arch::sm_90, "sm_90", 9, 0},      ArchRow{Arch::sm_100, "sm_100", 10, 0},
    ArchRow{Arch::sm_103, "sm_103", 10, 3},   ArchRow{Arch::sm_120, "sm_120", 12, 0},
    ArchRow{Arch::sm_121, "sm_121", 12, 1},
};
static_assert(kArchs.size() == static_cast<size_t>(Arch::sm_121) + 1);

constexpr std::array<Arch, kArchs.size()> arch_list() {
  std::array<Arch, kArchs.size()> out{};
  for (size_t i = 0; i < kArchs.size(); ++i) out[i] = kArchs[i].arch;
  return out;
}
constexpr auto kArchList = arch_list();

}  // namespace

std::span<const Arch> all_archs() { return kArchList; }

const char* name(Arch arch) { return kArchs.at(static_cast<size_t>(arch)).name; }

std::optional<Arch> parse_arch(std::string_view text) {
  for (const ArchRow& row : kArchs) {
    const std::string_view n = row.name;
    if (text == n) return row.arch;
    // "sm120" for "sm_120"
    if (n.starts_with("sm_") && text.size() == n.size() - 1 && text.starts_with("sm") && text.substr(2) == n.substr(3))
      return row.arch;
  }
  return std::nullopt;
}

Arch parse_arch_or_fail(std::string_view text, const std::string& flag) {
  if (auto a = parse_arch(text)) return *a;
  fail(ErrorCode::usage, {.field = flag}, "unknown architecture '" + std::string(text) + "' (one of " + arch_names() + ")");
}

std::optional<Arch> arch_of_capability(int major, int minor) {
  for (const ArchRow& row : kArchs)
    if (row.major == major && row.minor == minor) return row.arch;
  return std::nullopt;
}

std::string arch_names() {
  std::string s;
  for (const ArchRow& row : kArchs) s += (s.empty() ? "" : ", ") + std::string(row.name);
  return s;
}

std::vector<Arch> ArchSet::list() const {
  std::vector<Arch> out;
  for (Arch a : all_archs())
    if (has(a)) out.push_back(a);
  return out;
}

std::string ArchSet::names() const {
  std::string s;
  for (Arch a : list()) s += (s.empty() ? "" : ", ") + std::string(name(a));
  return s;
}

std::string ArchSet::compact() const {
  std::string s;
  const auto all = all_archs();
  for (size_t i = 0; i < all.size();) {
    if (!has(all[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j + 1 < all.size() && has(all[j + 1])) ++j;
    const auto add = [&](const std::string& part) { s += (s.empty() ? "" : ",") + part; };
    if (j - i >= 2) {
      add(std::string(name(all[i])) + ".." + name(all[j]));
    } else {
      for (size_t k = i; k <= j; ++k) add(name(all[k]));
    }
    i = j + 1;
  }
  return s;
}

}  // namespace keel
