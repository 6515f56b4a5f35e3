#include "plan/plan.h"

#include <algorithm>
#include <array>
#include <fmt/format.h>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "model/schema.h"

namespace keel {
namespace {

struct BackendRow {
  Backend backend;
  const char* target_flag;
  const char* draft_flag;
  std::span<const Op> ops;
};
constexpr Op kGemmOps[] = {Op::dense_gemm, Op::lm_head};
constexpr Op kMoeOps[] = {Op::moe_gemm};
constexpr Op kAttentionOps[] = {Op::attention_prefill, Op::attention_decode, Op::attention_verify};
constexpr std::array kBackends = {
    BackendRow{Backend::gemm, "--gemm-backend", "--draft-gemm-backend", kGemmOps},
    BackendRow{Backend::moe, "--moe-backend", "--draft-moe-backend", kMoeOps},
    BackendRow{Backend::attention, "--attention-backend", "--draft-attention-backend", kAttentionOps},
};
static_assert(kBackends.size() == static_cast<size_t>(Backend::attention) + 1);
constexpr std::array kBackendList = {Backend::gemm, Backend::moe, Backend::attention};

const BackendRow& row_of(Backend b) { return kBackends.at(static_cast<size_t>(b)); }

std::optional<Backend> backend_of(Op op) {
  for (const BackendRow& row : kBackends)
    if (std::find(row.ops.begin(), row.ops.end(), op) != row.ops.end()) return row.backend;
  return std::nullopt;
}

// One op to plan: where it runs and what it reads.
struct Site {
  int layer;
  ModelRole role;
  Op op;
  std::optional<WeightFormat> format;
  std::optional<AttentionKind> kind;  // attention, compressor, indexer, top-k
};

// The weight formats each layer's linears are stored in, read from the tensor schema so
// the plan and the loader can never disagree: {layer -> {op -> formats}}.
using LinearFormats = std::map<int, std::map<Op, std::set<WeightFormat>>>;

LinearFormats linear_formats(const ModelConfig& c) {
  LinearFormats out;
  for (const TensorSpec& spec : expected_tensors(c)) {
    if (spec.role != TensorRole::linear) continue;
    Op op = Op::dense_gemm;
    if (spec.layer < 0) op = spec.name.starts_with("embed") ? Op::embedding : Op::lm_head;
    else if (spec.name.find(".experts.") != std::string::npos) op = Op::moe_gemm;
    out[spec.layer][op].insert(spec.format);
  }
  return out;
}

void add_linear_sites(std::vector<Site>& sites, const LinearFormats& formats, int layer, ModelRole role, Op op) {
  const auto at = formats.find(layer);
  if (at == formats.end()) return;
  const auto ops = at->second.find(op);
  if (ops == at->second.end()) return;
  for (WeightFormat f : ops->second) sites.push_back({layer, role, op, f, std::nullopt});
}

// Every op of the model in execution order: per role, the top-level ops, then each layer.
std::vector<Site> sites_of(const PlanRequest& request) {
  const ModelConfig& c = request.config;
  const LinearFormats target = linear_formats(c);
  LinearFormats draft = target;
  if (request.draft_expert_format) {
    ModelConfig dc = c;
    dc.expert_format = *request.draft_expert_format;
    draft = linear_formats(dc);
  }
  const bool speculative = c.num_nextn_predict_layers > 0;
  std::vector<Site> sites;
  const auto layer_ops = [&](const LinearFormats& formats, int layer, ModelRole role) {
    const AttentionKind kind = c.attention.at(static_cast<size_t>(layer));
    sites.push_back({layer, role, Op::norm});
    sites.push_back({layer, role, Op::mhc});
    add_linear_sites(sites, formats, layer, role, Op::dense_gemm);
    sites.push_back({layer, role, Op::attention_prefill, std::nullopt, kind});
    sites.push_back({layer, role, Op::attention_decode, std::nullopt, kind});
    if (role == ModelRole::target && speculative) sites.push_back({layer, role, Op::attention_verify, std::nullopt, kind});
    if (kind != AttentionKind::sliding) sites.push_back({layer, role, Op::compressor, std::nullopt, kind});
    if (kind == AttentionKind::compressed_sparse) {
      sites.push_back({layer, role, Op::indexer, std::nullopt, kind});
      sites.push_back({layer, role, Op::topk, std::nullopt, kind});
    }
    sites.push_back({layer, role, Op::moe_routing});
    add_linear_sites(sites, formats, layer, role, Op::moe_gemm);
  };

  add_linear_sites(sites, target, -1, ModelRole::target, Op::embedding);
  sites.push_back({-1, ModelRole::target, Op::mhc});   // hc_head
  sites.push_back({-1, ModelRole::target, Op::norm});  // final norm
  add_linear_sites(sites, target, -1, ModelRole::target, Op::lm_head);
  sites.push_back({-1, ModelRole::target, Op::sampling});
  for (int l = 0; l < c.num_hidden_layers; ++l) layer_ops(target, l, ModelRole::target);
  if (speculative) {  // the draft embeds its tokens and reads its logits through the shared tables
    add_linear_sites(sites, draft, -1, ModelRole::draft, Op::embedding);
    add_linear_sites(sites, draft, -1, ModelRole::draft, Op::lm_head);
    sites.push_back({-1, ModelRole::draft, Op::sampling});
    for (int l = c.num_hidden_layers; l < c.num_layers_with_mtp(); ++l) layer_ops(draft, l, ModelRole::draft);
  }
  return sites;
}

bool can_run(const KernelInfo& k, const Site& s, Arch arch) {
  return k.archs.has(arch) && (!s.format || k.takes(*s.format)) && (!s.kind || k.handles(*s.kind));
}

// The kernels that can run a site, fastest first (registration order among equals).
std::vector<const KernelInfo*> candidates(const Registry& registry, const Site& s, Arch arch) {
  std::vector<const KernelInfo*> out;
  for (const KernelInfo* k : registry.for_op(s.op))
    if (can_run(*k, s, arch)) out.push_back(k);
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->priority > b->priority; });
  return out;
}

std::string names(const std::vector<const KernelInfo*>& kernels, const char* empty) {
  if (kernels.empty()) return empty;
  std::string s;
  for (const KernelInfo* k : kernels) s += (s.empty() ? "" : ", ") + k->name;
  return s;
}

std::string list(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : ",") + i;
  return s.empty() ? "-" : s;
}

std::string formats_of(const KernelInfo& k) {
  std::vector<std::string> out;
  for (WeightFormat f : k.formats) out.emplace_back(name(f));
  return list(out);
}

// "moe_gemm (mxfp4) on sm_120", "attention_decode (compressed_sparse) on sm_90"
std::string what(const Site& s, Arch arch) {
  std::string w = name(s.op);
  if (s.format) w += fmt::format(" ({})", name(*s.format));
  else if (s.kind) w += fmt::format(" ({} attention)", name(*s.kind));
  return w + " on " + name(arch);
}

// Why an explicit choice cannot run a site.
std::string why_not(const KernelInfo& k, const Site& s, Arch arch) {
  std::vector<std::string> lacks;
  if (!k.archs.has(arch)) lacks.push_back(fmt::format("runs on {} only", k.archs.names()));
  if (s.format && !k.takes(*s.format)) lacks.push_back(fmt::format("takes {} only", formats_of(k)));
  if (s.kind && !k.handles(*s.kind)) {
    std::vector<std::string> kinds;
    for (AttentionKind a : k.attention_kinds) kinds.emplace_back(name(a));
    lacks.push_back(fmt::format("handles {} attention only", list(kinds)));
  }
  std::string out;
  for (const auto& l : lacks) out += (out.empty() ? "" : " and ") + l;
  return out;
}

// Problems with the same text are reported once, with every layer they concern.
class Problems {
 public:
  void add(const Site& s, std::string text) {
    const auto key = std::make_pair(s.role, text);
    auto [it, fresh] = index_.try_emplace(key, items_.size());
    if (fresh) items_.push_back({s.role, std::move(text), {}});
    items_[it->second].layers.push_back(s.layer);
  }
  bool empty() const { return items_.empty(); }
  std::vector<std::string> lines(int trunk_layers) const {
    std::vector<std::string> out;
    for (const Item& i : items_)
      out.push_back(fmt::format("{} {}: {}", name(i.role), layers_label(i.layers, trunk_layers), i.text));
    return out;
  }

 private:
  struct Item {
    ModelRole role;
    std::string text;
    std::vector<int> layers;
  };
  std::vector<Item> items_;
  std::map<std::pair<ModelRole, std::string>, size_t> index_;
};

// The choice that governs a site: the kernel name ("" for auto), the flag it came from,
// and the flag to change when it cannot run.
struct Choice {
  std::string kernel;  // "" = auto
  std::string flag;    // "" when no flag was given
  std::string note;    // " (which the draft follows)" when the draft inherits it
  std::string change;
  std::string source() const { return flag + note; }
};

Choice choice_for(const PlanRequest& r, const Site& s) {
  const auto backend = backend_of(s.op);
  if (!backend) return {};
  const BackendRow& row = row_of(*backend);
  const auto pick = [](const std::string& chosen) { return chosen == "auto" ? std::string() : chosen; };
  if (s.role == ModelRole::draft && !r.draft[*backend].empty()) {
    return {pick(r.draft[*backend]), row.draft_flag, "", row.draft_flag};
  }
  const std::string& target = r.target[*backend];
  if (target.empty()) return {};  // not given: auto
  if (s.role == ModelRole::draft) {
    return {pick(target), row.target_flag, " (which the draft follows)",
            fmt::format("{} (or {} for both roles)", row.draft_flag, row.target_flag)};
  }
  return {pick(target), row.target_flag, "",
          r.config.num_nextn_predict_layers > 0
              ? fmt::format("{} (the draft follows it unless {} is given)", row.target_flag, row.draft_flag)
              : std::string(row.target_flag)};
}

// Unknown kernel names and draft options without a draft are usage errors, found before
// any op is looked at.
void check_choices(const PlanRequest& r, const Registry& registry) {
  for (const BackendRow& row : kBackends) {
    for (ModelRole role : {ModelRole::target, ModelRole::draft}) {
      const std::string& chosen = (role == ModelRole::target ? r.target : r.draft)[row.backend];
      const char* option = role == ModelRole::target ? row.target_flag : row.draft_flag;
      if (role == ModelRole::draft && !chosen.empty() && r.config.num_nextn_predict_layers == 0)
        fail(ErrorCode::usage, {.field = option}, "the model has no MTP (draft) layer to apply it to");
      if (chosen.empty() || chosen == "auto") continue;
      std::set<std::string> known;
      for (Op op : row.ops)
        for (const KernelInfo* k : registry.for_op(op)) known.insert(k->name);
      if (known.contains(chosen)) continue;
      std::string choices = "auto";
      for (const auto& k : known) choices += ", " + k;
      fail(ErrorCode::usage, {.field = option}, fmt::format("no kernel named '{}' in this binary (one of: {})", chosen, choices));
    }
  }
  if (r.draft_expert_format && r.config.num_nextn_predict_layers == 0)
    fail(ErrorCode::usage, {.field = "draft expert format"}, "the model has no MTP (draft) layer to apply it to");
}

// Compresses sorted ints: runs of step 1 as "a-b", longer runs of a larger step as "a,b,..,z".
std::string ranges(const std::vector<int>& v) {
  std::string s;
  size_t i = 0;
  while (i < v.size()) {
    size_t j = i + 1;
    if (j < v.size()) {
      const int step = v[j] - v[i];
      while (j + 1 < v.size() && v[j + 1] - v[j] == step) ++j;
      const size_t n = j - i + 1;
      if (step == 1 || n >= 3) {
        s += (s.empty() ? "" : ", ") +
             (step == 1 ? fmt::format("{}-{}", v[i], v[j]) : fmt::format("{},{},..,{}", v[i], v[i] + step, v[j]));
        i = j + 1;
        continue;
      }
    }
    s += (s.empty() ? "" : ", ") + std::to_string(v[i]);
    ++i;
  }
  return s;
}

}  // namespace

const char* name(ModelRole role) { return role == ModelRole::target ? "target" : "draft"; }

std::span<const Backend> all_backends() { return kBackendList; }
std::span<const Op> ops_of(Backend backend) { return row_of(backend).ops; }
const char* flag(Backend backend, ModelRole role) {
  return role == ModelRole::target ? row_of(backend).target_flag : row_of(backend).draft_flag;
}

const std::string& BackendChoices::operator[](Backend b) const {
  const std::string* fields[] = {&gemm, &moe, &attention};
  return *fields[static_cast<size_t>(b)];
}
std::string& BackendChoices::operator[](Backend b) {
  return const_cast<std::string&>(static_cast<const BackendChoices&>(*this)[b]);
}

std::string layer_label(int layer, int trunk_layers) {
  if (layer < 0) return "top level";
  if (layer < trunk_layers) return fmt::format("layer {}", layer);
  return fmt::format("mtp.{} (layer {})", layer - trunk_layers, layer);
}

std::string layers_label(std::vector<int> layers, int trunk_layers) {
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  std::vector<int> trunk, mtp;
  bool top = false;
  for (int l : layers) {
    if (l < 0) top = true;
    else if (l < trunk_layers) trunk.push_back(l);
    else mtp.push_back(l - trunk_layers);
  }
  std::vector<std::string> parts;
  if (top) parts.emplace_back("top level");
  if (!trunk.empty()) parts.push_back((trunk.size() == 1 ? "layer " : "layers ") + ranges(trunk));
  if (!mtp.empty()) parts.push_back("mtp." + ranges(mtp));
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : ", ") + p;
  return s;
}

Plan resolve_plan(const PlanRequest& r, const Registry& registry) {
  check_choices(r, registry);
  const ModelConfig& c = r.config;
  Plan plan{r.arch, c.num_hidden_layers, c.num_nextn_predict_layers, {}};
  Problems problems;
  for (const Site& s : sites_of(r)) {
    const Choice choice = choice_for(r, s);
    const std::vector<const KernelInfo*> can = candidates(registry, s, r.arch);
    const std::string would = "kernels that would run: " + names(can, "none in this binary");
    if (choice.kernel.empty()) {
      if (can.empty()) {
        std::string have;
        for (const KernelInfo* k : registry.for_op(s.op))
          have += fmt::format("{}{} [{}; {}]", have.empty() ? "" : ", ", k->name, k->archs.names(), formats_of(*k));
        problems.add(s, fmt::format("{}: no kernel in this binary runs it ({} kernels: {})", what(s, r.arch),
                                    name(s.op), have.empty() ? "none" : have));
        continue;
      }
      const std::string tag = choice.flag.empty() ? "auto" : "auto by " + choice.source();
      const std::string reason =
          can.size() == 1 ? fmt::format("{}: the only kernel that runs it", tag)
                          : fmt::format("{}: highest priority of {}", tag, names(can, ""));
      plan.entries.push_back({s.layer, s.role, s.op, s.format, can.front(), reason});
      continue;
    }
    const KernelInfo* k = registry.find(s.op, choice.kernel);
    if (k == nullptr) {
      problems.add(s, fmt::format("{}: {} '{}'{} has no {} kernel; {}; change {}", what(s, r.arch), choice.flag,
                                  choice.kernel, choice.note, name(s.op), would, choice.change));
      continue;
    }
    if (!can_run(*k, s, r.arch)) {
      problems.add(s, fmt::format("{}: {} '{}'{} {}; {}; change {}", what(s, r.arch), choice.flag, choice.kernel,
                                  choice.note, why_not(*k, s, r.arch), would, choice.change));
      continue;
    }
    plan.entries.push_back({s.layer, s.role, s.op, s.format, k, "chosen: " + choice.source()});
  }
  if (!problems.empty()) {
    const auto lines = problems.lines(c.num_hidden_layers);
    const auto& all = registry.kernels();
    const bool none = std::none_of(all.begin(), all.end(), [&](const KernelInfo& k) { return k.archs.has(r.arch); });
    fail(ErrorCode::kernel_plan, {.file = c.source},
         fmt::format("no kernel plan for {}: {}{} problem{}", name(r.arch),
                     none ? fmt::format("this binary has no kernel for {} at all; ", name(r.arch)) : "", lines.size(),
                     lines.size() == 1 ? "" : "s"),
         lines);
  }
  return plan;
}

const PlanEntry* Plan::find(int layer, ModelRole role, Op op, std::optional<WeightFormat> format) const {
  for (const PlanEntry& e : entries)
    if (e.layer == layer && e.role == role && e.op == op && (!format || e.format == format)) return &e;
  return nullptr;
}

const KernelInfo& Plan::kernel(int layer, ModelRole role, Op op, std::optional<WeightFormat> format) const {
  if (const PlanEntry* e = find(layer, role, op, format)) return *e->kernel;
  fail(ErrorCode::kernel_plan, {},
       fmt::format("the plan has no {} entry for {} {}{}", name(op), name(role), layer_label(layer, trunk_layers),
                   format ? fmt::format(" ({})", name(*format)) : ""));
}

std::string Plan::to_json() const {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const PlanEntry& e : entries) {
    nlohmann::ordered_json archs = nlohmann::ordered_json::array(), formats = nlohmann::ordered_json::array();
    for (Arch a : e.kernel->archs.list()) archs.push_back(name(a));
    if (e.format) formats.push_back(name(*e.format));
    out.push_back({{"layer", e.layer},
                   {"role", name(e.role)},
                   {"op", name(e.op)},
                   {"kernel", e.kernel->name},
                   {"archs", archs},
                   {"formats", formats},
                   {"reason", e.reason}});
  }
  return nlohmann::ordered_json{{"arch", name(arch)}, {"entries", out}}.dump(2);
}

std::string Plan::table(bool per_layer) const {
  struct Row {
    const PlanEntry* first;
    std::vector<int> layers;
  };
  std::vector<Row> rows;
  std::map<std::tuple<ModelRole, Op, int, std::string, std::string>, size_t> index;
  for (const PlanEntry& e : entries) {
    if (per_layer) {
      rows.push_back({&e, {e.layer}});
      continue;
    }
    const auto key = std::make_tuple(e.role, e.op, e.format ? static_cast<int>(*e.format) : -1, e.kernel->name, e.reason);
    auto [it, fresh] = index.try_emplace(key, rows.size());
    if (fresh) rows.push_back({&e, {}});
    rows[it->second].layers.push_back(e.layer);
  }
  std::string s = fmt::format("kernel plan for {}: {} target layer{}, {} draft (MTP) layer{}\n", name(arch),
                              trunk_layers, trunk_layers == 1 ? "" : "s", mtp_layers, mtp_layers == 1 ? "" : "s");
  s += fmt::format("{:<6}  {:<22}  {:<17}  {:<9}  {:<14}  {:<16}  {}\n", "role", "layers", "op", "format", "kernel",
                   "archs", "reason");
  for (const Row& row : rows) {
    const PlanEntry& e = *row.first;
    s += fmt::format("{:<6}  {:<22}  {:<17}  {:<9}  {:<14}  {:<16}  {}\n", name(e.role),
                     layers_label(row.layers, trunk_layers), name(e.op), e.format ? name(*e.format) : "-",
                     e.kernel->name, e.kernel->archs.compact(), e.reason);
  }
  return s;
}

std::string Plan::summary() const {
  std::vector<std::pair<std::string, int>> uses;
  for (const PlanEntry& e : entries) {
    auto it = std::find_if(uses.begin(), uses.end(), [&](const auto& u) { return u.first == e.kernel->name; });
    if (it == uses.end()) uses.emplace_back(e.kernel->name, 1);
    else ++it->second;
  }
  std::string kernels;
  for (const auto& [k, n] : uses) kernels += fmt::format("{}{} ({})", kernels.empty() ? "" : ", ", k, n);
  return fmt::format("kernel plan for {}: {} target + {} draft layers, {} entries; kernels: {}", name(arch), trunk_layers,
                     mtp_layers, entries.size(), kernels);
}

}  // namespace keel
