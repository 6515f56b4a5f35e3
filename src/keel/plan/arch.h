// The architectures a kernel plan is made for: the CPU, and the NVIDIA GPUs keel targets,
// named by exact compute capability. A kernel lists the exact architectures it runs on;
// nothing is inferred from a major version (sm_103 is not sm_100, sm_120 lacks sm_100's
// tcgen05/TMEM), which is the mistake that sends SM100-only kernels to other GPUs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

// In capability order: every GPU arch after sm_80 has warp-level mma.sync, which the
// portable kernels rely on; the arch-specific instructions (wgmma on sm_90, tcgen05 on
// sm_100/sm_103, block-scaled FP4 mma.sync on sm_120/sm_121) exist on their archs only.
enum class Arch : uint8_t { cpu, sm_80, sm_86, sm_89, sm_90, sm_100, sm_103, sm_120, sm_121 };

// Every Arch, in capability order.
std::span<const Arch> all_archs();
const char* name(Arch arch);
// "cpu", "sm_120" or "sm120"; nullopt for anything else.
std::optional<Arch> parse_arch(std::string_view text);
// The same, or Error(usage) naming `flag` and listing the valid names.
Arch parse_arch_or_fail(std::string_view text, const std::string& flag);
// A device's compute capability (12, 0) -> sm_120; nullopt for a GPU keel has no name for.
std::optional<Arch> arch_of_capability(int major, int minor);
// The comma-separated list of all names, for help texts and errors.
std::string arch_names();

// A set of architectures (one bit each).
class ArchSet {
 public:
  constexpr ArchSet() = default;
  constexpr ArchSet(std::initializer_list<Arch> archs) {
    for (Arch a : archs) bits_ |= bit(a);
  }
  // `first` and every GPU arch after it in capability order (portable mma.sync kernels).
  static constexpr ArchSet gpus_from(Arch first) {
    ArchSet s;
    for (int a = static_cast<int>(first); a <= static_cast<int>(Arch::sm_121); ++a) s.bits_ |= bit(static_cast<Arch>(a));
    s.bits_ &= ~bit(Arch::cpu);
    return s;
  }

  constexpr ArchSet with(Arch a) const {
    ArchSet s = *this;
    s.bits_ |= bit(a);
    return s;
  }
  constexpr bool has(Arch a) const { return (bits_ & bit(a)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr bool operator==(const ArchSet&) const = default;
  std::vector<Arch> list() const;  // in capability order
  std::string names() const;       // "sm_80, sm_86"
  std::string compact() const;     // runs of 3+ in capability order shortened: "sm_80..sm_121"

 private:
  static constexpr uint16_t bit(Arch a) { return static_cast<uint16_t>(1u << static_cast<unsigned>(a)); }
  uint16_t bits_ = 0;
};

}  // namespace keel
