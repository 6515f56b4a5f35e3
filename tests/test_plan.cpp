// The kernel plan: architectures, the registry, and the resolver over the whole matrix
// architecture x formats x role x user choice, on registries of fake kernels declared
// here. Expected kernels come from a small oracle in this file that applies the
// documented rules (docs/kernel-plan.md) to the fake declarations, never from the
// resolver itself.
#include "plan/plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "synth/synth.h"
#include "testing.h"

namespace keel {
namespace {

using WF = WeightFormat;
using AK = AttentionKind;

// --- Architectures ---------------------------------------------------------------------

TEST(Arch, NamesRoundTripAndCapabilities) {
  const std::vector<std::string> names = {"cpu",    "sm_80",  "sm_86",  "sm_89", "sm_90",
                                          "sm_100", "sm_103", "sm_120", "sm_121"};
  ASSERT_EQ(all_archs().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(name(all_archs()[i]), names[i]);
    EXPECT_EQ(parse_arch(names[i]), all_archs()[i]);
  }
  EXPECT_EQ(parse_arch("sm120"), Arch::sm_120);
  EXPECT_EQ(parse_arch("sm_87"), std::nullopt);
  EXPECT_EQ(parse_arch("SM_120"), std::nullopt);
  EXPECT_EQ(parse_arch(""), std::nullopt);
  EXPECT_EQ(arch_of_capability(12, 0), Arch::sm_120);
  EXPECT_EQ(arch_of_capability(12, 1), Arch::sm_121);
  EXPECT_EQ(arch_of_capability(10, 3), Arch::sm_103);
  EXPECT_EQ(arch_of_capability(9, 0), Arch::sm_90);
  EXPECT_EQ(arch_of_capability(8, 7), std::nullopt);  // Orin: not a target
  const std::string msg = KEEL_EXPECT_ERROR(parse_arch_or_fail("sm_999", "--arch"), ErrorCode::usage);
  EXPECT_NE(msg.find("sm_999"), std::string::npos);
  EXPECT_NE(msg.find("sm_121"), std::string::npos) << "lists the valid names";
}

TEST(Arch, SetsAreExact) {
  const ArchSet sm100{Arch::sm_100};
  EXPECT_TRUE(sm100.has(Arch::sm_100));
  EXPECT_FALSE(sm100.has(Arch::sm_103));  // no major-version inference
  EXPECT_FALSE(sm100.has(Arch::sm_120));
  const ArchSet portable = ArchSet::gpus_from(Arch::sm_80);
  EXPECT_FALSE(portable.has(Arch::cpu));
  EXPECT_EQ(portable.names(), "sm_80, sm_86, sm_89, sm_90, sm_100, sm_103, sm_120, sm_121");
  EXPECT_EQ(ArchSet::gpus_from(Arch::sm_120), (ArchSet{Arch::sm_120, Arch::sm_121}));
  EXPECT_TRUE(ArchSet{}.empty());
  EXPECT_EQ(portable.compact(), "sm_80..sm_121");
  EXPECT_EQ((ArchSet{Arch::cpu, Arch::sm_90, Arch::sm_100, Arch::sm_120, Arch::sm_121}).compact(),
            "cpu,sm_90,sm_100,sm_120,sm_121");
  EXPECT_EQ((ArchSet{Arch::sm_86, Arch::sm_89, Arch::sm_90, Arch::sm_103}).compact(), "sm_86..sm_90,sm_103");
}

// --- Fake registries -------------------------------------------------------------------

const std::vector<WF> kAllFormats = {WF::bf16, WF::f32, WF::fp8_block, WF::mxfp4, WF::nvfp4};

KernelInfo fake(std::string name, Op op, ArchSet archs, std::vector<WF> formats, int priority,
                std::vector<AK> kinds = {}) {
  return {.name = std::move(name), .op = op, .archs = archs, .formats = std::move(formats),
          .attention_kinds = std::move(kinds), .priority = priority};
}

// The test's own declaration table: what the oracle reads and the registry is built from.
std::vector<KernelInfo> fake_kernels() {
  std::vector<KernelInfo> ks;
  for (Op op : all_ops()) {  // a CPU and a portable GPU kernel for every op
    const bool w = op_takes_weights(op);
    ks.push_back(fake("cpu", op, {Arch::cpu}, w ? kAllFormats : std::vector<WF>{}, 0));
    if (op != Op::moe_gemm && op != Op::dense_gemm && op != Op::attention_decode)
      ks.push_back(fake("portable", op, ArchSet::gpus_from(Arch::sm_80), w ? kAllFormats : std::vector<WF>{}, 10));
  }
  // MoE: the seed case's cast.
  ks.push_back(fake("trtllm_sm100", Op::moe_gemm, {Arch::sm_100}, {WF::nvfp4, WF::mxfp4}, 100));
  ks.push_back(fake("sm120_nvfp4", Op::moe_gemm, {Arch::sm_120}, {WF::nvfp4}, 50));
  ks.push_back(fake("portable_mma", Op::moe_gemm, ArchSet::gpus_from(Arch::sm_80), {WF::mxfp4, WF::nvfp4}, 10));
  // Dense: an FP8-only Hopper kernel and a portable one for everything else.
  ks.push_back(fake("fp8_sm90", Op::dense_gemm, {Arch::sm_90}, {WF::fp8_block}, 30));
  ks.push_back(fake("portable", Op::dense_gemm, ArchSet::gpus_from(Arch::sm_80), kAllFormats, 10));
  // Attention: decode has a faster sliding-window-only kernel; "sliding_only" has no
  // prefill or verify kernel at all.
  ks.push_back(fake("sliding_only", Op::attention_decode, ArchSet::gpus_from(Arch::sm_80), {}, 20, {AK::sliding}));
  ks.push_back(fake("portable", Op::attention_decode, ArchSet::gpus_from(Arch::sm_80), {}, 10));
  return ks;
}

Registry registry_of(const std::vector<KernelInfo>& kernels) {
  Registry r;
  for (const KernelInfo& k : kernels) r.add(k);
  return r;
}

// The tiny preset: layers 0-1 sliding, 2 CSA, 3 HCA, 4 CSA, then MTP layer 5 (sliding);
// FP8 dense linears, bf16 router/compressor/embedding/head, MXFP4 experts.
ModelConfig tiny(int mtp_layers = 1) { return synth_config({.shape = "tiny", .mtp_layers = mtp_layers}); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// --- The oracle: the rules applied to the declaration table ------------------------------

// What the rules say for one op: a kernel name, or "" when the op cannot be planned.
std::string oracle(const std::vector<KernelInfo>& ks, Op op, Arch arch, std::optional<WF> format,
                   std::optional<AK> kind, const std::string& choice) {
  const auto fits = [&](const KernelInfo& k) {
    if (k.op != op) return false;
    bool arch_ok = false;
    for (Arch a : k.archs.list()) arch_ok = arch_ok || a == arch;
    bool format_ok = !format.has_value();
    for (WF f : k.formats) format_ok = format_ok || f == *format;
    bool kind_ok = !kind.has_value() || k.attention_kinds.empty();
    for (AK a : k.attention_kinds) kind_ok = kind_ok || a == *kind;
    return arch_ok && format_ok && kind_ok;
  };
  if (choice.empty() || choice == "auto") {
    const KernelInfo* best = nullptr;
    for (const KernelInfo& k : ks)
      if (fits(k) && (!best || k.priority > best->priority)) best = &k;
    return best ? best->name : "";
  }
  for (const KernelInfo& k : ks)
    if (k.name == choice && fits(k)) return k.name;
  return "";
}

// The choice that applies to a role: the draft's own when given, else the target's.
std::string effective(const std::string& target, const std::string& draft, ModelRole role) {
  return role == ModelRole::draft && !draft.empty() ? draft : target;
}

const std::vector<Arch> kArchs(all_archs().begin(), all_archs().end());

// --- The seed case ----------------------------------------------------------------------

// Target NVFP4 experts, draft (MTP) MXFP4 experts, --moe-backend given explicitly, on
// sm_120: the draft runs a kernel that runs on sm_120, or startup fails naming the draft
// layer, op, arch, format, the kernels that would run and the flag; never the SM100-only
// kernel.
TEST(PlanSeedCase, NvFp4TargetMxFp4DraftExplicitMoeBackendOnSm120) {
  ModelConfig c = tiny();
  c.expert_format = WF::nvfp4;
  const Registry reg = registry_of(fake_kernels());
  const auto request = [&](std::string moe, std::string draft_moe = "") {
    return PlanRequest{.config = c, .arch = Arch::sm_120, .target = {.moe = std::move(moe)},
                       .draft = {.moe = std::move(draft_moe)}, .draft_expert_format = WF::mxfp4};
  };

  // The sm_120-only NVFP4 kernel: right for the target, and the draft would inherit it,
  // but it cannot take the draft's MXFP4: startup error, not a fallback.
  const std::string msg = KEEL_EXPECT_ERROR(resolve_plan(request("sm120_nvfp4"), reg), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "no kernel plan for sm_120: 1 problem")) << msg;
  EXPECT_TRUE(contains(msg, "draft mtp.0: moe_gemm (mxfp4) on sm_120")) << msg;
  EXPECT_TRUE(contains(msg, "--moe-backend 'sm120_nvfp4' (which the draft follows) takes nvfp4 only")) << msg;
  EXPECT_TRUE(contains(msg, "kernels that would run: portable_mma;")) << msg;
  EXPECT_TRUE(contains(msg, "change --draft-moe-backend (or --moe-backend for both roles)")) << msg;
  EXPECT_FALSE(contains(msg, "target")) << "the target's choice is valid: " << msg;

  // The fix the message names: the draft gets its own choice.
  for (const std::string draft : {"auto", "portable_mma"}) {
    const Plan p = resolve_plan(request("sm120_nvfp4", draft), reg);
    EXPECT_EQ(p.kernel(0, ModelRole::target, Op::moe_gemm, WF::nvfp4).name, "sm120_nvfp4");
    EXPECT_EQ(p.kernel(5, ModelRole::draft, Op::moe_gemm, WF::mxfp4).name, "portable_mma") << draft;
  }

  // A portable explicit choice serves both roles.
  const Plan portable = resolve_plan(request("portable_mma"), reg);
  EXPECT_EQ(portable.kernel(4, ModelRole::target, Op::moe_gemm, WF::nvfp4).name, "portable_mma");
  EXPECT_EQ(portable.kernel(5, ModelRole::draft, Op::moe_gemm, WF::mxfp4).name, "portable_mma");
  EXPECT_EQ(portable.find(5, ModelRole::draft, Op::moe_gemm)->reason, "chosen: --moe-backend (which the draft follows)");

  // Asking for the SM100-only kernel on sm_120 fails for both roles, at plan time.
  const std::string sm100 = KEEL_EXPECT_ERROR(resolve_plan(request("trtllm_sm100"), reg), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(sm100, "target layers 0-4: moe_gemm (nvfp4) on sm_120: --moe-backend 'trtllm_sm100' runs on sm_100 only")) << sm100;
  EXPECT_TRUE(contains(sm100, "draft mtp.0: moe_gemm (mxfp4) on sm_120")) << sm100;
  EXPECT_TRUE(contains(sm100, "kernels that would run: sm120_nvfp4, portable_mma;")) << sm100;

  // Whatever is chosen, no plan on sm_120 holds the SM100-only kernel.
  for (const std::string target : {"", "auto", "trtllm_sm100", "sm120_nvfp4", "portable_mma", "cpu"}) {
    for (const std::string draft : {"", "auto", "trtllm_sm100", "sm120_nvfp4", "portable_mma", "cpu"}) {
      try {
        const Plan p = resolve_plan(request(target, draft), reg);
        for (const PlanEntry& e : p.entries) {
          EXPECT_NE(e.kernel->name, "trtllm_sm100");
          EXPECT_TRUE(e.kernel->archs.has(Arch::sm_120)) << e.kernel->name;
        }
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kernel_plan) << e.what();
      }
    }
  }

  // All auto on sm_100: the SM100 kernel is the fastest there, for both roles.
  PlanRequest on_sm100 = request("");
  on_sm100.arch = Arch::sm_100;
  const Plan p100 = resolve_plan(on_sm100, reg);
  EXPECT_EQ(p100.kernel(0, ModelRole::target, Op::moe_gemm).name, "trtllm_sm100");
  EXPECT_EQ(p100.kernel(5, ModelRole::draft, Op::moe_gemm).name, "trtllm_sm100");
}

// --- The matrix -------------------------------------------------------------------------

// arch x target expert format x draft expert format x --moe-backend x --draft-moe-backend:
// every moe_gemm entry is the oracle's kernel, and the plan fails exactly when the
// oracle finds an op nothing may run, with a message naming it.
TEST(PlanMatrix, MoeBackendOverArchFormatsRolesAndChoices) {
  const auto ks = fake_kernels();
  const Registry reg = registry_of(ks);
  const std::vector<WF> formats = {WF::mxfp4, WF::nvfp4, WF::fp8_block, WF::bf16};
  const std::vector<std::string> choices = {"", "auto", "cpu", "trtllm_sm100", "sm120_nvfp4", "portable_mma"};
  int plans = 0, errors = 0;
  for (Arch arch : kArchs) {
    for (WF tf : formats) {
      ModelConfig c = tiny();
      c.expert_format = tf;
      for (WF df : formats) {
        for (const auto& tc : choices) {
          for (const auto& dc : choices) {
            const PlanRequest r{.config = c, .arch = arch, .target = {.moe = tc}, .draft = {.moe = dc},
                                .draft_expert_format = df};
            const std::string want_t = oracle(ks, Op::moe_gemm, arch, tf, {}, effective(tc, dc, ModelRole::target));
            const std::string want_d = oracle(ks, Op::moe_gemm, arch, df, {}, effective(tc, dc, ModelRole::draft));
            const std::string where = fmt::format("{} target {} draft {} --moe-backend '{}' --draft-moe-backend '{}'",
                                                  name(arch), name(tf), name(df), tc, dc);
            // Other ops: auto over kernels that exist for every arch, so only MoE can fail.
            if (!want_t.empty() && !want_d.empty()) {
              const Plan p = resolve_plan(r, reg);
              ++plans;
              for (int l = 0; l < 5; ++l) EXPECT_EQ(p.kernel(l, ModelRole::target, Op::moe_gemm, tf).name, want_t) << where;
              EXPECT_EQ(p.kernel(5, ModelRole::draft, Op::moe_gemm, df).name, want_d) << where;
              for (const PlanEntry& e : p.entries) {
                EXPECT_TRUE(e.kernel->archs.has(arch)) << where << " " << e.kernel->name;
                if (e.format) {
                  EXPECT_TRUE(e.kernel->takes(*e.format)) << where << " " << e.kernel->name;
                }
              }
              continue;
            }
            ++errors;
            const std::string msg = KEEL_EXPECT_ERROR(resolve_plan(r, reg), ErrorCode::kernel_plan);
            EXPECT_TRUE(contains(msg, fmt::format("no kernel plan for {}", name(arch)))) << where << "\n" << msg;
            if (want_t.empty()) {
              EXPECT_TRUE(contains(msg, fmt::format("target layers 0-4: moe_gemm ({}) on {}", name(tf), name(arch))))
                  << where << "\n" << msg;
              if (!tc.empty() && tc != "auto") {
                EXPECT_TRUE(contains(msg, "change --moe-backend (the draft follows it")) << where << "\n" << msg;
              }
            }
            if (want_d.empty()) {
              EXPECT_TRUE(contains(msg, fmt::format("draft mtp.0: moe_gemm ({}) on {}", name(df), name(arch))))
                  << where << "\n" << msg;
              const bool own = !dc.empty() && dc != "auto";
              const bool inherited = dc.empty() && !tc.empty() && tc != "auto";
              if (own) {
                EXPECT_TRUE(contains(msg, "change --draft-moe-backend\n") || msg.ends_with("change --draft-moe-backend"))
                    << where << "\n" << msg;
              }
              if (inherited) {
                EXPECT_TRUE(contains(msg, "change --draft-moe-backend (or --moe-backend for both roles)"))
                    << where << "\n" << msg;
              }
            }
            if (!want_t.empty()) {
              EXPECT_FALSE(contains(msg, "target")) << where << "\n" << msg;
            }
            if (!want_d.empty()) {
              EXPECT_FALSE(contains(msg, "draft mtp")) << where << "\n" << msg;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(plans, 400);  // both outcomes are well represented
  EXPECT_GT(errors, 400);
}

// arch x --gemm-backend / --attention-backend for each role: dense linears come in two
// formats per layer (FP8 projections, bf16 router and compressors) plus the bf16
// lm_head, and attention ops differ by layer kind and role (verify: target only).
TEST(PlanMatrix, GemmAndAttentionBackendsOverArchKindsAndRoles) {
  const auto ks = fake_kernels();
  const Registry reg = registry_of(ks);
  const ModelConfig c = tiny();
  ASSERT_EQ(c.dense_format, WF::fp8_block);
  const std::vector<AK> kinds = {AK::sliding, AK::sliding, AK::compressed_sparse, AK::heavily_compressed,
                                 AK::compressed_sparse, AK::sliding};  // layers 0-4, mtp.0
  ASSERT_EQ(c.attention, kinds);
  const std::vector<std::string> gemm = {"", "cpu", "fp8_sm90", "portable"};
  const std::vector<std::string> attn = {"", "cpu", "sliding_only", "portable"};
  for (Arch arch : kArchs) {
    for (const auto& gt : gemm) for (const auto& gd : gemm) for (const auto& at : attn) for (const auto& ad : attn) {
      const PlanRequest r{.config = c, .arch = arch, .target = {.gemm = gt, .attention = at},
                          .draft = {.gemm = gd, .attention = ad}};
      const std::string where =
          fmt::format("{} gemm '{}'/'{}' attention '{}'/'{}'", name(arch), gt, gd, at, ad);
      // Every (layer, role, op, format, kind) the rules cover, spelled out for this config.
      struct Want { int layer; ModelRole role; Op op; std::optional<WF> format; std::optional<AK> kind; std::string kernel; };
      std::vector<Want> wants;
      const auto want = [&](int layer, ModelRole role, Op op, std::optional<WF> f, std::optional<AK> kind,
                            const std::string& t, const std::string& d) {
        wants.push_back({layer, role, op, f, kind, oracle(ks, op, arch, f, kind, effective(t, d, role))});
      };
      for (ModelRole role : {ModelRole::target, ModelRole::draft}) want(-1, role, Op::lm_head, WF::bf16, {}, gt, gd);
      for (int l = 0; l < 6; ++l) {
        const ModelRole role = l < 5 ? ModelRole::target : ModelRole::draft;
        for (WF f : {WF::fp8_block, WF::bf16}) want(l, role, Op::dense_gemm, f, {}, gt, gd);
        want(l, role, Op::attention_prefill, {}, kinds[l], at, ad);
        want(l, role, Op::attention_decode, {}, kinds[l], at, ad);
        if (role == ModelRole::target) want(l, role, Op::attention_verify, {}, kinds[l], at, ad);
      }
      bool ok = true;
      for (const Want& w : wants) ok = ok && !w.kernel.empty();
      if (ok) {
        const Plan p = resolve_plan(r, reg);
        for (const Want& w : wants) {
          const PlanEntry* e = p.find(w.layer, w.role, w.op, w.format);
          ASSERT_NE(e, nullptr) << where << " " << name(w.op);
          EXPECT_EQ(e->kernel->name, w.kernel) << where << " " << layer_label(w.layer, 5) << " " << name(w.op);
        }
        EXPECT_EQ(p.find(5, ModelRole::draft, Op::attention_verify), nullptr);
        continue;
      }
      const std::string msg = KEEL_EXPECT_ERROR(resolve_plan(r, reg), ErrorCode::kernel_plan);
      // One line per failing (role, op, format or kind), and none for the others.
      std::set<std::string> failing;
      for (const Want& w : wants) {
        if (!w.kernel.empty()) continue;
        std::string op = name(w.op);
        op += w.format ? fmt::format(" ({})", name(*w.format)) : fmt::format(" ({} attention)", name(*w.kind));
        failing.insert(fmt::format("{}|{} on {}", name(w.role), op, name(arch)));
      }
      std::set<std::string> reported;
      for (const std::string& line : [&] {
             std::vector<std::string> lines;
             size_t at = 0;
             while ((at = msg.find("\n  ", at)) != std::string::npos) {
               at += 3;
               lines.push_back(msg.substr(at, msg.find('\n', at) - at));
             }
             return lines;
           }()) {
        const size_t space = line.find(' '), colon = line.find(": ");
        ASSERT_NE(colon, std::string::npos) << line;
        const std::string rest = line.substr(colon + 2);
        reported.insert(line.substr(0, space) + "|" + rest.substr(0, rest.find(": ")));
      }
      EXPECT_EQ(reported, failing) << where << "\n" << msg;
    }
  }
}

// --- Rules one at a time ----------------------------------------------------------------

TEST(Plan, ExplicitChoiceNamesEverythingAndTheWorkingKernels) {
  const Registry reg = registry_of(fake_kernels());
  const ModelConfig c = tiny();
  const std::string msg = KEEL_EXPECT_ERROR(
      resolve_plan({.config = c, .arch = Arch::sm_120, .target = {.gemm = "fp8_sm90"}}, reg), ErrorCode::kernel_plan);
  // Hopper-only FP8 on sm_120, and FP8-only on the bf16 router/compressors and lm_head.
  EXPECT_TRUE(contains(msg, "target layers 0-4: dense_gemm (fp8_block) on sm_120: --gemm-backend 'fp8_sm90' runs on sm_90 only; "
                            "kernels that would run: portable; change --gemm-backend (the draft follows it unless "
                            "--draft-gemm-backend is given)")) << msg;
  EXPECT_TRUE(contains(msg, "target top level: lm_head (bf16) on sm_120: --gemm-backend 'fp8_sm90' has no lm_head "
                            "kernel; kernels that would run: portable")) << msg;
  EXPECT_TRUE(contains(msg, "draft mtp.0: dense_gemm (bf16) on sm_120: --gemm-backend 'fp8_sm90' (which the draft "
                            "follows) runs on sm_90 only and takes fp8_block only; kernels that would run: portable; "
                            "change --draft-gemm-backend (or --gemm-backend for both roles)")) << msg;
}

TEST(Plan, AutoPicksTheFastestThatRunsAndRespectsAttentionKinds) {
  const Registry reg = registry_of(fake_kernels());
  const ModelConfig c = tiny();
  const Plan p = resolve_plan({.config = c, .arch = Arch::sm_90}, reg);
  EXPECT_EQ(p.kernel(0, ModelRole::target, Op::dense_gemm, WF::fp8_block).name, "fp8_sm90");
  EXPECT_EQ(p.kernel(0, ModelRole::target, Op::dense_gemm, WF::bf16).name, "portable");
  EXPECT_EQ(p.kernel(0, ModelRole::target, Op::attention_decode).name, "sliding_only");  // sliding
  EXPECT_EQ(p.kernel(2, ModelRole::target, Op::attention_decode).name, "portable");      // CSA
  EXPECT_EQ(p.kernel(3, ModelRole::target, Op::attention_decode).name, "portable");      // HCA
  EXPECT_EQ(p.kernel(5, ModelRole::draft, Op::attention_decode).name, "sliding_only");
  EXPECT_EQ(p.kernel(0, ModelRole::target, Op::moe_gemm).name, "portable_mma");  // trtllm is sm_100 only
  EXPECT_EQ(p.find(0, ModelRole::target, Op::dense_gemm, WF::fp8_block)->reason,
            "auto: highest priority of fp8_sm90, portable");
  EXPECT_EQ(p.find(0, ModelRole::target, Op::norm)->reason, "auto: the only kernel that runs it");

  // Equal priorities: the first registered wins.
  Registry tie;
  for (const KernelInfo& k : fake_kernels())
    if (k.op != Op::norm) tie.add(k);
  tie.add(fake("norm_b", Op::norm, {Arch::cpu}, {}, 5));
  tie.add(fake("norm_a", Op::norm, {Arch::cpu}, {}, 5));
  EXPECT_EQ(resolve_plan({.config = c}, tie).kernel(0, ModelRole::target, Op::norm).name, "norm_b");
}

TEST(Plan, DraftOverrideAndInheritance) {
  const Registry reg = registry_of(fake_kernels());
  const ModelConfig c = tiny();
  // cpu on sm_90 cannot run: the target choice is named, and the draft's inherited one.
  const std::string msg =
      KEEL_EXPECT_ERROR(resolve_plan({.config = c, .arch = Arch::sm_90, .target = {.moe = "cpu"}}, reg), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "2 problems")) << msg;
  const Plan p = resolve_plan(
      {.config = c, .arch = Arch::sm_90, .target = {.moe = "portable_mma"}, .draft = {.attention = "portable"}}, reg);
  EXPECT_EQ(p.find(5, ModelRole::draft, Op::moe_gemm)->reason, "chosen: --moe-backend (which the draft follows)");
  EXPECT_EQ(p.find(5, ModelRole::draft, Op::attention_decode)->reason, "chosen: --draft-attention-backend");
  EXPECT_EQ(p.kernel(0, ModelRole::target, Op::attention_decode).name, "sliding_only");  // target still auto
}

TEST(Plan, UnknownNamesAndDraftOptionsWithoutADraftAreUsageErrors) {
  const Registry reg = registry_of(fake_kernels());
  const ModelConfig c = tiny();
  std::string msg = KEEL_EXPECT_ERROR(resolve_plan({.config = c, .target = {.moe = "marlin"}}, reg), ErrorCode::usage);
  EXPECT_TRUE(contains(msg, "field '--moe-backend': no kernel named 'marlin' in this binary (one of: auto, cpu, "
                            "portable_mma, sm120_nvfp4, trtllm_sm100)")) << msg;
  msg = KEEL_EXPECT_ERROR(resolve_plan({.config = c, .draft = {.attention = "flash"}}, reg), ErrorCode::usage);
  EXPECT_TRUE(contains(msg, "--draft-attention-backend")) << msg;
  // A name that exists for one attention op but not another: a plan error on the op.
  msg = KEEL_EXPECT_ERROR(resolve_plan({.config = c, .arch = Arch::sm_80, .target = {.attention = "sliding_only"}}, reg),
                          ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "attention_prefill (sliding attention) on sm_80: --attention-backend 'sliding_only' has no "
                            "attention_prefill kernel")) << msg;
  EXPECT_TRUE(contains(msg, "target layers 2, 4: attention_decode (compressed_sparse attention) on sm_80: "
                            "--attention-backend 'sliding_only' handles sliding attention only")) << msg;

  const ModelConfig no_mtp = tiny(0);
  msg = KEEL_EXPECT_ERROR(resolve_plan({.config = no_mtp, .draft = {.moe = "cpu"}}, reg), ErrorCode::usage);
  EXPECT_TRUE(contains(msg, "no MTP (draft) layer")) << msg;
  KEEL_EXPECT_ERROR(resolve_plan({.config = no_mtp, .draft_expert_format = WF::nvfp4}, reg), ErrorCode::usage);
  const Plan p = resolve_plan({.config = no_mtp}, reg);
  for (const PlanEntry& e : p.entries) {
    EXPECT_EQ(e.role, ModelRole::target);
    EXPECT_NE(e.op, Op::attention_verify) << "nothing to verify without a draft";
  }
}

TEST(Plan, NoKernelForAnOpIsAnErrorNotALateCrash) {
  Registry reg;
  for (const KernelInfo& k : fake_kernels())
    if (k.op != Op::topk || k.name == "cpu") reg.add(k);
  const std::string msg =
      KEEL_EXPECT_ERROR(resolve_plan({.config = tiny(), .arch = Arch::sm_121}, reg), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "no kernel plan for sm_121: 1 problem [kernel_plan]\n  target layers 2, 4: topk (compressed_sparse attention) "
                            "on sm_121: no kernel in this binary runs it (topk kernels: cpu [cpu; -])")) << msg;
}

// --- The plan's contents for the tiny preset, with the builtin (CPU) registry ------------

TEST(Plan, EveryOpOfEveryLayerAndRole) {
  const ModelConfig c = tiny();
  const Plan p = resolve_plan({.config = c});
  // Per layer: norm, mhc, dense_gemm (fp8_block, bf16), prefill, decode, routing,
  // moe_gemm = 8; target +verify; CSA +compressor, indexer, topk; HCA +compressor.
  // Target: 5 top + 9 + 9 + 12 + 10 + 12; draft: 3 top + 8.
  EXPECT_EQ(p.entries.size(), 5u + 9 + 9 + 12 + 10 + 12 + 3 + 8);
  EXPECT_EQ(p.trunk_layers, 5);
  EXPECT_EQ(p.mtp_layers, 1);
  std::map<int, std::multiset<std::string>> ops;
  for (const PlanEntry& e : p.entries) {
    EXPECT_EQ(e.kernel->name, "cpu");
    ops[e.layer * 2 + static_cast<int>(e.role)].insert(name(e.op));
  }
  const std::multiset<std::string> sliding = {"norm", "mhc", "dense_gemm", "dense_gemm", "attention_prefill",
                                              "attention_decode", "attention_verify", "moe_routing", "moe_gemm"};
  auto csa = sliding, hca = sliding;
  csa.insert({"compressor", "indexer", "topk"});
  hca.insert("compressor");
  auto draft = sliding;
  draft.erase("attention_verify");
  EXPECT_EQ(ops[0 * 2], sliding);
  EXPECT_EQ(ops[1 * 2], sliding);
  EXPECT_EQ(ops[2 * 2], csa);
  EXPECT_EQ(ops[3 * 2], hca);
  EXPECT_EQ(ops[4 * 2], csa);
  EXPECT_EQ(ops[5 * 2 + 1], draft);
  EXPECT_EQ(ops[-2], (std::multiset<std::string>{"embedding", "mhc", "norm", "lm_head", "sampling"}));
  EXPECT_EQ(ops[-1], (std::multiset<std::string>{"embedding", "lm_head", "sampling"}));
  EXPECT_EQ(p.find(-1, ModelRole::target, Op::lm_head)->format, WF::bf16);
  EXPECT_EQ(p.find(5, ModelRole::draft, Op::moe_gemm)->format, WF::mxfp4);
}

TEST(Plan, DraftExpertFormatComesFromTheRequest) {
  ModelConfig c = tiny();
  c.expert_format = WF::nvfp4;
  const Plan p = resolve_plan({.config = c, .draft_expert_format = WF::mxfp4});
  EXPECT_EQ(p.find(0, ModelRole::target, Op::moe_gemm)->format, WF::nvfp4);
  EXPECT_EQ(p.find(5, ModelRole::draft, Op::moe_gemm)->format, WF::mxfp4);
  EXPECT_EQ(p.find(5, ModelRole::draft, Op::moe_gemm, WF::nvfp4), nullptr);
}

TEST(Plan, OutputsAsDataTableAndSummary) {
  const Registry reg = registry_of(fake_kernels());
  ModelConfig c = tiny();
  c.expert_format = WF::nvfp4;
  const Plan p = resolve_plan({.config = c, .arch = Arch::sm_120, .draft_expert_format = WF::mxfp4}, reg);
  const auto j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(j["arch"], "sm_120");
  ASSERT_EQ(j["entries"].size(), p.entries.size());
  bool seen = false;
  for (const auto& e : j["entries"]) {
    for (const char* key : {"layer", "role", "op", "kernel", "archs", "formats", "reason"})
      ASSERT_TRUE(e.contains(key)) << key;
    if (e["layer"] == 5 && e["op"] == "moe_gemm") {
      seen = true;
      EXPECT_EQ(e["role"], "draft");
      EXPECT_EQ(e["kernel"], "portable_mma");
      EXPECT_EQ(e["formats"], nlohmann::json::array({"mxfp4"}));
      EXPECT_EQ(e["archs"], nlohmann::json::array({"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "sm_121"}));
    }
    if (e["op"] == "norm") {
      EXPECT_EQ(e["formats"], nlohmann::json::array());
    }
  }
  EXPECT_TRUE(seen);
  const std::string table = p.table();
  EXPECT_TRUE(contains(table, "kernel plan for sm_120: 5 target layers, 1 draft (MTP) layer\n")) << table;
  EXPECT_TRUE(contains(table, "target  layers 0-4")) << table;
  EXPECT_TRUE(contains(table, "target  layers 2, 4")) << table;
  EXPECT_TRUE(contains(table, "draft   mtp.0")) << table;
  EXPECT_TRUE(contains(table, "sm120_nvfp4")) << table;
  const std::string per_layer = p.table(true);
  EXPECT_EQ(std::count(per_layer.begin(), per_layer.end(), '\n'), static_cast<long>(p.entries.size()) + 2);
  EXPECT_LT(std::count(table.begin(), table.end(), '\n'), std::count(per_layer.begin(), per_layer.end(), '\n'));
  EXPECT_TRUE(p.summary().starts_with("kernel plan for sm_120: 5 target + 1 draft layers, ")) << p.summary();
  EXPECT_TRUE(contains(p.summary(), "sm120_nvfp4 (5)")) << p.summary();

  const std::string missing = KEEL_EXPECT_ERROR(p.kernel(5, ModelRole::draft, Op::attention_verify), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(missing, "no attention_verify entry for draft mtp.0 (layer 5)")) << missing;
}

TEST(Plan, LayerLabels) {
  EXPECT_EQ(layer_label(-1, 5), "top level");
  EXPECT_EQ(layer_label(3, 5), "layer 3");
  EXPECT_EQ(layer_label(6, 5), "mtp.1 (layer 6)");
  EXPECT_EQ(layers_label({3}, 43), "layer 3");
  EXPECT_EQ(layers_label({1, 0, -1}, 43), "top level, layers 0-1");
  EXPECT_EQ(layers_label({2, 4, 6, 8, 10}, 43), "layers 2,4,..,10");
  EXPECT_EQ(layers_label({0, 1, 2, 4, 6, 8, 43, 44}, 43), "layers 0-2, 4,6,..,8, mtp.0-1");
  EXPECT_EQ(layers_label({3, 7}, 43), "layers 3, 7");
}

// --- Registry -----------------------------------------------------------------------------

TEST(Registry, RejectsBadDeclarations) {
  Registry r;
  r.add(fake("a", Op::norm, {Arch::cpu}, {}, 0));
  std::string msg = KEEL_EXPECT_ERROR(r.add(fake("a", Op::norm, {Arch::sm_80}, {}, 1)), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "kernel 'a' (norm): registered twice")) << msg;
  r.add(fake("a", Op::mhc, {Arch::cpu}, {}, 0));  // the same name for another op is fine
  KEEL_EXPECT_ERROR(r.add(fake("b", Op::norm, {}, {}, 0)), ErrorCode::kernel_plan);
  KEEL_EXPECT_ERROR(r.add(fake("b", Op::moe_gemm, {Arch::cpu}, {}, 0)), ErrorCode::kernel_plan);
  KEEL_EXPECT_ERROR(r.add(fake("b", Op::norm, {Arch::cpu}, {WF::bf16}, 0)), ErrorCode::kernel_plan);
  KEEL_EXPECT_ERROR(r.add(fake("auto", Op::norm, {Arch::cpu}, {}, 0)), ErrorCode::kernel_plan);
  KEEL_EXPECT_ERROR(r.add(fake("", Op::norm, {Arch::cpu}, {}, 0)), ErrorCode::kernel_plan);
  EXPECT_EQ(r.kernels().size(), 2u);
}

TEST(Registry, BuiltinHoldsTheCpuKernelsItWasLinkedWith) {
  const Registry& r = Registry::builtin();
  for (Op op : all_ops()) {
    const KernelInfo* k = r.find(op, "cpu");
    ASSERT_NE(k, nullptr) << name(op) << ": the CPU reference covers every op";
    EXPECT_EQ(k->archs, ArchSet{Arch::cpu});
    EXPECT_NE(k->entry, nullptr);
  }
  // The entries are the functions the forward pass calls.
  EXPECT_EQ(r.find(Op::dense_gemm, "cpu")->entry_as<decltype(linear)>(), &linear);
  EXPECT_EQ(r.find(Op::moe_gemm, "cpu")->entry_as<decltype(linear)>(), &linear);
  EXPECT_EQ(r.find(Op::embedding, "cpu")->entry_as<decltype(decode_row)>(), &decode_row);
  EXPECT_EQ(r.find(Op::attention_decode, "cpu")->entry_as<decltype(attend)>(), &attend);
  EXPECT_EQ(r.find(Op::indexer, "cpu")->entry_as<decltype(indexer_select)>(), &indexer_select);
  EXPECT_EQ(r.find(Op::norm, "cpu")->entry_as<decltype(rms_norm)>(), &rms_norm);
  const std::string msg =
      KEEL_EXPECT_ERROR(r.find(Op::norm, "cpu")->entry_as<decltype(rms_norm_unweighted)>(), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "wrong function type")) << msg;
  // Test binaries link keel_core without the CUDA library: no GPU kernel can be listed,
  // only the host sampler that GPU plans use (the CPU sampler over copied-back logits).
  for (const KernelInfo& k : r.kernels()) {
    if (k.op == Op::sampling && k.name == "host") {
      EXPECT_EQ(k.archs, ArchSet::gpus_from(Arch::sm_80));
      EXPECT_EQ(k.entry, r.find(Op::sampling, "cpu")->entry);
      continue;
    }
    EXPECT_EQ(k.archs, ArchSet{Arch::cpu}) << k.name;
  }

  const auto j = nlohmann::json::parse(r.to_json());
  ASSERT_EQ(j["kernels"].size(), r.kernels().size());
  const auto& first = j["kernels"][0];
  EXPECT_EQ(first["name"], "cpu");
  EXPECT_EQ(first["op"], "embedding");
  EXPECT_EQ(first["archs"], nlohmann::json::array({"cpu"}));
  EXPECT_EQ(first["formats"], nlohmann::json::array({"bf16", "f32", "fp8_block", "mxfp4", "nvfp4"}));
}

TEST(Registry, BuiltinPlansTheCpuAndRefusesGpusItHasNoKernelsFor) {
  const ModelConfig c = tiny();
  EXPECT_NO_THROW(resolve_plan({.config = c, .arch = Arch::cpu}));
  for (Arch arch : kArchs) {
    if (arch == Arch::cpu) continue;
    const std::string msg = KEEL_EXPECT_ERROR(resolve_plan({.config = c, .arch = arch}), ErrorCode::kernel_plan);
    EXPECT_TRUE(contains(msg, fmt::format("target layers 0-4: dense_gemm (fp8_block) on {}: no kernel in this binary runs "
                                          "it (dense_gemm kernels: cpu [cpu; bf16,f32,fp8_block,mxfp4,nvfp4])",
                                          name(arch)))) << msg;
  }
}

TEST(Registry, KernelsCheckTheArchTheyRunOn) {
  const KernelInfo k = fake("portable_mma", Op::moe_gemm, ArchSet::gpus_from(Arch::sm_80), {WF::mxfp4}, 10);
  EXPECT_NO_THROW(check_runs_on(k, Arch::sm_120));
  const KernelInfo sm100 = fake("trtllm_sm100", Op::moe_gemm, {Arch::sm_100}, {WF::nvfp4}, 100);
  const std::string msg = KEEL_EXPECT_ERROR(check_runs_on(sm100, Arch::sm_120), ErrorCode::kernel_plan);
  EXPECT_TRUE(contains(msg, "kernel 'trtllm_sm100' (moe_gemm) called on sm_120")) << msg;
  EXPECT_TRUE(contains(msg, "it runs on sm_100")) << msg;
}

}  // namespace
}  // namespace keel
