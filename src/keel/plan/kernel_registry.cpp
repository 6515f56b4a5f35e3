#include "plan/kernel_registry.h"

#include <algorithm>
#include <array>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

// The CUDA library's registration, declared weak: keel_core is linked alone into the
// CPU-only tests and tools, where the symbol is absent and the address is null; the
// keel binary links keel_cuda (when CUDA is built), whose `--undefined` link option
// (CMakeLists.txt) pulls cuda/kernels.cu out of the static library so that the strong
// definition is there. A weak symbol keeps keel_core free of any CUDA build switch: the
// same object file serves both links, and what is registered is what is linked.
extern "C" __attribute__((weak)) void keel_register_cuda_kernels(keel::Registry& registry);

namespace keel {
namespace {

struct OpRow {
  Op op;
  const char* name;
  bool takes_weights;
};
constexpr std::array kOps = {
    OpRow{Op::embedding, "embedding", true},
    OpRow{Op::dense_gemm, "dense_gemm", true},
    OpRow{Op::moe_gemm, "moe_gemm", true},
    OpRow{Op::lm_head, "lm_head", true},
    OpRow{Op::moe_routing, "moe_routing", false},
    OpRow{Op::attention_prefill, "attention_prefill", false},
    OpRow{Op::attention_decode, "attention_decode", false},
    OpRow{Op::attention_verify, "attention_verify", false},
    OpRow{Op::compressor, "compressor", false},
    OpRow{Op::indexer, "indexer", false},
    OpRow{Op::topk, "topk", false},
    OpRow{Op::mhc, "mhc", false},
    OpRow{Op::norm, "norm", false},
    OpRow{Op::sampling, "sampling", false},
};
static_assert(kOps.size() == static_cast<size_t>(Op::sampling) + 1);

constexpr auto kOpList = [] {
  std::array<Op, kOps.size()> out{};
  for (size_t i = 0; i < kOps.size(); ++i) out[i] = kOps[i].op;
  return out;
}();

constexpr std::array kFormats = {WeightFormat::bf16, WeightFormat::f32, WeightFormat::fp8_block, WeightFormat::mxfp4,
                                 WeightFormat::nvfp4};
static_assert(kFormats.size() == static_cast<size_t>(WeightFormat::nvfp4) + 1);

template <typename T>
std::vector<std::string> names_of(const std::vector<T>& items) {
  std::vector<std::string> out;
  for (const T& item : items) out.emplace_back(name(item));
  return out;
}

std::string joined(const std::vector<std::string>& items, const char* empty) {
  if (items.empty()) return empty;
  std::string s;
  for (const auto& item : items) s += (s.empty() ? "" : ",") + item;
  return s;
}

}  // namespace

std::span<const Op> all_ops() { return kOpList; }
const char* name(Op op) { return kOps.at(static_cast<size_t>(op)).name; }
bool op_takes_weights(Op op) { return kOps.at(static_cast<size_t>(op)).takes_weights; }

std::optional<Op> parse_op(std::string_view text) {
  for (const OpRow& row : kOps)
    if (text == row.name) return row.op;
  return std::nullopt;
}

const char* name(Activation activation) {
  static constexpr const char* kNames[] = {"f32", "bf16", "fp8_e4m3", "mxfp8"};
  static_assert(std::size(kNames) == static_cast<size_t>(Activation::mxfp8) + 1);
  return kNames[static_cast<size_t>(activation)];
}

std::span<const WeightFormat> all_weight_formats() { return kFormats; }

std::optional<WeightFormat> parse_weight_format(std::string_view text) {
  for (WeightFormat f : kFormats)
    if (text == name(f)) return f;
  return std::nullopt;
}

bool KernelInfo::takes(WeightFormat format) const {
  return std::find(formats.begin(), formats.end(), format) != formats.end();
}

bool KernelInfo::handles(AttentionKind kind) const {
  return attention_kinds.empty() ||
         std::find(attention_kinds.begin(), attention_kinds.end(), kind) != attention_kinds.end();
}

void KernelInfo::wrong_signature() const {
  fail(ErrorCode::kernel_plan, {},
       "kernel '" + name + "' (" + keel::name(op) + ") " +
           (entry == nullptr ? "has no entry point in this binary" : "was asked for with the wrong function type"));
}

const KernelInfo& Registry::add(KernelInfo k) {
  const std::string what = "kernel '" + k.name + "' (" + name(k.op) + ")";
  const auto bad = [&](const std::string& why) { fail(ErrorCode::kernel_plan, {}, what + ": " + why); };
  if (k.name.empty() || k.name == "auto") bad("needs a name other than 'auto'");
  if (k.archs.empty()) bad("runs on no architecture");
  if (op_takes_weights(k.op) == k.formats.empty())
    bad(op_takes_weights(k.op) ? "must list the weight formats it takes" : "takes no weights, so lists no formats");
  if (find(k.op, k.name)) bad("registered twice");
  kernels_.push_back(std::move(k));
  return kernels_.back();
}

std::vector<const KernelInfo*> Registry::for_op(Op op) const {
  std::vector<const KernelInfo*> out;
  for (const KernelInfo& k : kernels_)
    if (k.op == op) out.push_back(&k);
  return out;
}

const KernelInfo* Registry::find(Op op, std::string_view name) const {
  for (const KernelInfo& k : kernels_)
    if (k.op == op && k.name == name) return &k;
  return nullptr;
}

const Registry& Registry::builtin() {
  static const Registry registry = [] {
    Registry r;
    register_cpu_kernels(r);
    if (keel_register_cuda_kernels != nullptr) keel_register_cuda_kernels(r);
    return r;
  }();
  return registry;
}

std::string Registry::to_json() const {
  nlohmann::ordered_json kernels = nlohmann::ordered_json::array();
  for (const KernelInfo& k : kernels_) {
    nlohmann::ordered_json archs = nlohmann::ordered_json::array();
    for (Arch a : k.archs.list()) archs.push_back(name(a));
    kernels.push_back({{"name", k.name},
                       {"op", name(k.op)},
                       {"archs", archs},
                       {"formats", names_of(k.formats)},
                       {"activations", names_of(k.activations)},
                       {"attention", names_of(k.attention_kinds)},
                       {"priority", k.priority},
                       {"summary", k.summary}});
  }
  return nlohmann::ordered_json{{"kernels", kernels}}.dump(2);
}

std::string Registry::table() const {
  std::string s = fmt::format("{:<18} {:<16} {:<16} {:<30} {:<5} {:>4}  {}\n", "op", "kernel", "archs", "formats",
                              "acts", "prio", "summary");
  for (Op op : all_ops()) {
    for (const KernelInfo* k : for_op(op)) {
      s += fmt::format("{:<18} {:<16} {:<16} {:<30} {:<5} {:>4}  {}\n", name(op), k->name,
                       k->archs.compact(), joined(names_of(k->formats), "-"),
                       joined(names_of(k->activations), "-"), k->priority, k->summary);
    }
  }
  return s;
}

}  // namespace keel
