// The kernels this binary holds, each with the op it implements, the architectures it
// runs on and the weight formats it takes. The registry is filled by code that sits next
// to the kernels and takes their addresses (ops/cpu_kernels.cpp, and cuda/kernels.cu
// when the CUDA library is linked), so a kernel that is not compiled in cannot appear.
// The resolver (plan.h) chooses from it; `keel plan --list-kernels` prints it.
#pragma once

#include <cstdint>
#include <deque>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "base/error.h"
#include "io/config.h"
#include "plan/arch.h"

namespace keel {

// What a kernel computes. The first four read a weight in a stored format and are
// resolved per format; the others take no weights.
enum class Op : uint8_t {
  embedding,          // token id -> embedding row
  dense_gemm,         // every non-expert linear of a layer (attention, shared expert, router, compressors)
  moe_gemm,           // routed experts' grouped GEMM
  lm_head,            // final hidden state -> logits
  moe_routing,        // router scores, top-k / hash selection, combine weights
  attention_prefill,  // a chunk of prompt tokens
  attention_decode,   // one new token per sequence
  attention_verify,   // the target scoring a run of draft tokens
  compressor,         // pools a window of tokens into a compressed KV entry (CSA, HCA)
  indexer,            // lightning indexer scores over compressed entries (CSA)
  topk,               // the indexer's top-k selection (CSA)
  mhc,                // manifold-constrained hyper-connections (mix, collapse, expand, head)
  norm,               // RMSNorm
  sampling,           // logits -> next token
};
std::span<const Op> all_ops();
const char* name(Op op);
std::optional<Op> parse_op(std::string_view text);
// Whether kernels of `op` read a weight and are chosen per weight format.
bool op_takes_weights(Op op);

// Activation (input) precision a kernel computes in; reported, not resolved.
enum class Activation : uint8_t { f32, bf16, fp8_e4m3, mxfp8 };
const char* name(Activation activation);

std::span<const WeightFormat> all_weight_formats();
std::optional<WeightFormat> parse_weight_format(std::string_view text);

struct KernelInfo {
  std::string name;     // unique per op; what --moe-backend and friends name
  Op op = Op::dense_gemm;
  ArchSet archs;        // exact archs it was compiled for and runs on
  std::vector<WeightFormat> formats;  // weights it takes (empty for ops without weights)
  std::vector<Activation> activations;
  std::vector<AttentionKind> attention_kinds;  // layer kinds it handles; empty: all
  int priority = 0;     // `auto` picks the highest among those that can run
  std::string summary;  // one line for the listing

  // The kernel's entry point, its type checked on the way out; null for a kernel that
  // is only declared (tests' fake registries).
  using Entry = void (*)();
  Entry entry = nullptr;
  const std::type_info* signature = nullptr;

  template <typename Fn>
  KernelInfo& with_entry(Fn* fn) {
    entry = reinterpret_cast<Entry>(fn);  // round-trips back through entry_as<Fn>
    signature = &typeid(Fn*);
    return *this;
  }
  template <typename Fn>
  bool has_entry() const {
    return entry != nullptr && *signature == typeid(Fn*);
  }
  template <typename Fn>
  Fn* entry_as() const {
    if (entry == nullptr || *signature != typeid(Fn*)) wrong_signature();
    return reinterpret_cast<Fn*>(entry);
  }

  bool takes(WeightFormat format) const;
  bool handles(AttentionKind kind) const;

 private:
  [[noreturn]] void wrong_signature() const;
};

class Registry {
 public:
  // Checks the declaration (a name, an arch, formats iff the op takes weights, no
  // duplicate name for the op); Error(kernel_plan) otherwise.
  const KernelInfo& add(KernelInfo kernel);

  const std::deque<KernelInfo>& kernels() const { return kernels_; }
  std::vector<const KernelInfo*> for_op(Op op) const;
  const KernelInfo* find(Op op, std::string_view name) const;

  // Every kernel compiled into this binary: the CPU ones, plus the CUDA ones when the
  // CUDA library is linked. Built once.
  static const Registry& builtin();

  // {"kernels": [{"name", "op", "archs": [...], "formats": [...], "activations": [...],
  //   "priority", "summary"}, ...]}
  std::string to_json() const;
  std::string table() const;

 private:
  std::deque<KernelInfo> kernels_;  // stable addresses: plans point into it
};

// Registers the CPU reference kernels (ops/cpu_kernels.cpp).
void register_cpu_kernels(Registry& registry);

// What a kernel's caller checks, once per call: one bit test that the arch it is running
// on is one the plan validated for this kernel; Error(kernel_plan) naming both otherwise.
inline void check_runs_on(const KernelInfo& kernel, Arch running) {
  if (!kernel.archs.has(running)) [[unlikely]] {
    fail(ErrorCode::kernel_plan, {},
         "kernel '" + kernel.name + "' (" + name(kernel.op) + ") called on " + name(running) +
             ", which the plan did not validate it for (it runs on " + kernel.archs.names() + ")");
  }
}

}  // namespace keel
