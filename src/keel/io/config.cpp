#include "io/config.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/error.h"

namespace keel {
namespace {

using json = nlohmann::json;

// Every dimension fits in 31 bits, so the product of two never overflows int64.
constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMinI64 = std::numeric_limits<int64_t>::min();

// ---------------------------------------------------------------------------------------
// Defaults. The dimensions are required; every other key defaults to its DeepSeek-V4-Flash
// value, which is also the transformers 5.17 default (dsv4-forward.md §1.1,
// dsv4-checkpoint.md §1.1).

enum class Need : uint8_t { required, defaulted, csa };  // csa: required when a CSA layer exists

using IntMember = std::variant<std::monostate, int ModelConfig::*, int64_t ModelConfig::*>;

struct IntKey {
  std::string_view key;
  Need need;
  int64_t fallback;  // when defaulted
  int64_t lo, hi;
  IntMember member;            // monostate: checked, not stored
  std::string_view why = {};   // appended to range errors
};

const IntKey kIntKeys[] = {
    {"vocab_size", Need::required, 0, 1, kMaxDim, &ModelConfig::vocab_size},
    {"hidden_size", Need::required, 0, 1, kMaxDim, &ModelConfig::hidden_size},
    {"num_hidden_layers", Need::required, 0, 1, kMaxDim, &ModelConfig::num_hidden_layers},
    {"num_attention_heads", Need::required, 0, 1, kMaxDim, &ModelConfig::num_attention_heads},
    {"num_key_value_heads", Need::defaulted, 1, 1, 1, {}, " (DeepSeek-V4 has one shared K=V head)"},
    {"head_dim", Need::required, 0, 1, kMaxDim, &ModelConfig::head_dim},
    {"q_lora_rank", Need::required, 0, 1, kMaxDim, &ModelConfig::q_lora_rank},
    {"o_groups", Need::required, 0, 1, kMaxDim, &ModelConfig::o_groups},
    {"o_lora_rank", Need::required, 0, 1, kMaxDim, &ModelConfig::o_lora_rank},
    {"sliding_window", Need::required, 0, 1, kMaxDim, &ModelConfig::sliding_window},
    {"index_n_heads", Need::csa, 0, 1, kMaxDim, &ModelConfig::index_n_heads},
    {"index_head_dim", Need::csa, 0, 1, kMaxDim, &ModelConfig::index_head_dim},
    {"index_topk", Need::csa, 0, 1, kMaxDim, &ModelConfig::index_topk},
    {"hc_mult", Need::required, 0, 1, kMaxDim, &ModelConfig::hc_mult},
    {"hc_sinkhorn_iters", Need::defaulted, 20, 0, kMaxDim, &ModelConfig::hc_sinkhorn_iters},
    {"n_routed_experts", Need::required, 0, 1, kMaxDim, &ModelConfig::n_routed_experts},
    {"n_shared_experts", Need::defaulted, 1, 1, 1, &ModelConfig::n_shared_experts,
     " (one shared expert of width moe_intermediate_size; transformers ignores the count)"},
    {"num_experts_per_tok", Need::required, 0, 1, kMaxDim, &ModelConfig::num_experts_per_tok},
    {"moe_intermediate_size", Need::required, 0, 1, kMaxDim, &ModelConfig::moe_intermediate_size},
    {"max_position_embeddings", Need::defaulted, 1048576, 1, kMaxI64,
     &ModelConfig::max_position_embeddings},
    {"bos_token_id", Need::defaulted, 0, 0, kMaxDim, &ModelConfig::bos_token_id},
    {"eos_token_id", Need::defaulted, 1, 0, kMaxDim, &ModelConfig::eos_token_id},
    {"num_nextn_predict_layers", Need::defaulted, 1, 0, kMaxDim,
     &ModelConfig::num_nextn_predict_layers},
};

struct RealKey {
  std::string_view key;
  double fallback;
  double lo;
  bool lo_open;  // value must be > lo (else >= lo)
  double ModelConfig::*member;
};

const RealKey kRealKeys[] = {
    {"hc_eps", 1e-6, 0.0, false, &ModelConfig::hc_eps},
    {"routed_scaling_factor", 1.5, 0.0, true, &ModelConfig::routed_scaling_factor},
    {"swiglu_limit", 10.0, 0.0, false, &ModelConfig::swiglu_limit},
    {"rms_norm_eps", 1e-6, 0.0, true, &ModelConfig::rms_norm_eps},
};

// The keys read outside the two tables above.
struct Defaults {
  int64_t num_hash_layers = 3;
  int64_t compress_rate_csa = 4;
  int64_t compress_rate_hca = 128;
  double partial_rotary_factor = 64.0 / 512.0;  // qk_rope_head_dim 64 of head_dim 512
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  double yarn_beta_fast = 32.0;  // yarn keys that may be left out (transformers defaults);
  double yarn_beta_slow = 1.0;   // original_max_position_embeddings: max_position_embeddings
  ScoringFunc scoring_func = ScoringFunc::sqrtsoftplus;
  bool tie_word_embeddings = false;
  WeightFormat float_format = WeightFormat::bf16;  // torch_dtype / dtype
};
constexpr Defaults kDefaults;
// No default schedule: transformers' (V4-Pro style) is not Flash's, so compress_ratios or
// layer_types is required. rope_scaling absent: the compress rope is plain, as in transformers.

// ---------------------------------------------------------------------------------------
// Names: each table is the one place a string maps to a value.

template <class E>
using Names = std::span<const std::pair<std::string_view, E>>;

constexpr std::pair<std::string_view, AttentionKind> kLayerTypes[] = {
    {"sliding_attention", AttentionKind::sliding},
    {"compressed_sparse_attention", AttentionKind::compressed_sparse},
    {"heavily_compressed_attention", AttentionKind::heavily_compressed},
};
constexpr std::pair<std::string_view, MlpKind> kMlpTypes[] = {
    {"hash_moe", MlpKind::hash_moe},
    {"moe", MlpKind::moe},
};
constexpr std::pair<std::string_view, ScoringFunc> kScoringFuncs[] = {
    {"sqrtsoftplus", ScoringFunc::sqrtsoftplus},
    {"sigmoid", ScoringFunc::sigmoid},
};
constexpr std::pair<std::string_view, WeightFormat> kFloatDtypes[] = {
    {"bfloat16", WeightFormat::bf16},
    {"float32", WeightFormat::f32},
};
constexpr std::pair<std::string_view, WeightFormat> kExpertDtypes[] = {
    {"fp4", WeightFormat::mxfp4},
    {"fp8", WeightFormat::fp8_block},
};

enum class RopeType : uint8_t { plain, yarn };
constexpr std::pair<std::string_view, RopeType> kRopeTypes[] = {
    {"default", RopeType::plain},
    {"yarn", RopeType::yarn},
};

// quantization_config. Accepted:
//   quant_method "fp8": DeepSeek's FP8 block format for the dense linears, fmt "e4m3",
//     scale_fmt "ue8m0" (absent: f32 scales), weight_block_size [rows, cols] (default
//     [128, 128]), activation_scheme "dynamic"; experts from expert_dtype.
//   moe_quant_algo "NVFP4" (NVIDIA's DeepSeek-V4 re-quants, as vLLM and SGLang read them):
//     the same FP8 dense linears, routed experts in NVFP4.
//   quant_method "modelopt" with quant_algo "NVFP4", or quant_algo "MIXED_PRECISION" plus
//     moe_quant_algo "NVFP4": likewise FP8 dense and NVFP4 experts (those re-quants touch
//     only the routed experts).
enum class QuantMethod : uint8_t { fp8, modelopt };
constexpr std::pair<std::string_view, QuantMethod> kQuantMethods[] = {
    {"fp8", QuantMethod::fp8},
    {"modelopt", QuantMethod::modelopt},
};
enum class ModeloptAlgo : uint8_t { nvfp4, mixed };
constexpr std::pair<std::string_view, ModeloptAlgo> kModeloptAlgos[] = {
    {"NVFP4", ModeloptAlgo::nvfp4},
    {"MIXED_PRECISION", ModeloptAlgo::mixed},
};
// Keys with a single accepted value: the lookup only validates.
constexpr std::pair<std::string_view, bool> kFp8Fmts[] = {{"e4m3", true}};
constexpr std::pair<std::string_view, bool> kScaleFmts[] = {{"ue8m0", true}};
constexpr std::pair<std::string_view, bool> kActivationSchemes[] = {{"dynamic", true}};
constexpr std::pair<std::string_view, bool> kMoeQuantAlgos[] = {{"NVFP4", true}};
constexpr std::pair<std::string_view, bool> kModelTypes[] = {{"deepseek_v4", true}};

template <class E>
std::optional<E> lookup(Names<E> table, std::string_view text) {
  for (const auto& [name, value] : table)
    if (name == text) return value;
  return std::nullopt;
}

template <class E>
std::string_view spelling(Names<E> table, E value) {
  for (const auto& [name, v] : table)
    if (v == value) return name;
  return "?";
}

template <class E>
std::string listing(Names<E> table) {
  std::string s;
  for (const auto& entry : table) s += (s.empty() ? "'" : ", '") + std::string(entry.first) + "'";
  return s;
}

// A user string for a message: escaped, and cut short so a huge value cannot flood it.
std::string excerpt(std::string_view text) {
  constexpr size_t kMax = 60;
  std::string cut(text.substr(0, kMax));
  if (text.size() > kMax) cut += "...";
  return json(cut).dump(-1, ' ', false, json::error_handler_t::replace);
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "object";
    case json::value_t::array: return "array";
    case json::value_t::string: return "string";
    case json::value_t::boolean: return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "float";
    default: return "binary";  // never produced by the text parser
  }
}

std::string range_text(int64_t lo, int64_t hi) {
  return lo == hi ? fmt::format("must be {}", lo) : fmt::format("must be in [{}, {}]", lo, hi);
}

// ---------------------------------------------------------------------------------------
// Typed reading. A Section is one JSON object of the config plus the dotted path of its
// keys, so that every error names the file and the full field ("rope_scaling.factor").
// Values are only ever referenced, never copied or dumped: both recurse on nesting.

class Section {
 public:
  Section(const json& object, std::string path, const std::string& source)
      : object_(&object), path_(std::move(path)), source_(&source) {}

  std::string field(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  ErrorContext context(std::string_view key) const { return {.file = *source_, .field = field(key)}; }
  ErrorContext context() const { return {.file = *source_, .field = path_}; }

  [[noreturn]] void fail(ErrorCode code, std::string_view key, const std::string& message) const {
    keel::fail(code, context(key), message);
  }
  void require(bool ok, std::string_view key, const std::string& message) const {
    if (!ok) fail(ErrorCode::config_value, key, message);
  }

  // JSON null counts as absent: transformers writes unset options as null.
  const json* find(std::string_view key) const {
    const auto it = object_->find(key);
    return it == object_->end() || it->is_null() ? nullptr : &*it;
  }

  // `why` explains the range in the error.
  std::optional<int64_t> integer(std::string_view key, int64_t lo, int64_t hi, std::string_view why = {}) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    return as_integer(*v, key, kWhole, lo, hi, why);
  }

  // Any JSON number (an integer is fine where a float is expected). Always finite: the
  // JSON parser refuses numbers that overflow a double.
  std::optional<double> number(std::string_view key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_number()) wrong_type(key, kWhole, "number", *v);
    return v->get<double>();
  }

  std::optional<bool> boolean(std::string_view key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) wrong_type(key, kWhole, "boolean", *v);
    return v->get<bool>();
  }

  std::optional<std::string> string(std::string_view key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) wrong_type(key, kWhole, "string", *v);
    return v->get<std::string>();
  }

  // A string key that must be one of `table`'s names.
  template <class E, size_t N>
  std::optional<E> choice(std::string_view key, const std::pair<std::string_view, E> (&table)[N],
                          std::string_view hint = {}) const {
    const auto text = string(key);
    if (!text) return std::nullopt;
    if (const auto value = lookup(Names<E>(table), *text)) return value;
    fail(ErrorCode::config_value, key,
         fmt::format("unknown value {} (expected {}){}", excerpt(*text), listing(Names<E>(table)), hint));
  }

  std::optional<Section> section(std::string_view key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_object()) wrong_type(key, kWhole, "object", *v);
    return Section(*v, field(key), *source_);
  }

  std::optional<std::vector<int64_t>> integers(std::string_view key, int64_t lo, int64_t hi) const {
    const json* v = array(key);
    if (!v) return std::nullopt;
    std::vector<int64_t> out;
    out.reserve(v->size());
    for (const json& e : *v) out.push_back(as_integer(e, key, out.size(), lo, hi));
    return out;
  }

  std::optional<std::vector<std::string>> strings(std::string_view key) const {
    const json* v = array(key);
    if (!v) return std::nullopt;
    std::vector<std::string> out;
    out.reserve(v->size());
    for (const json& e : *v) {
      if (!e.is_string()) wrong_type(key, out.size(), "string", e);
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  // The value of a key, or entry `index` of the list at a key; messages name the entry.
  static constexpr size_t kWhole = SIZE_MAX;
  static std::string entry(size_t index) { return index == kWhole ? "" : fmt::format("entry {}: ", index); }

  const json* array(std::string_view key) const {
    const json* v = find(key);
    if (v && !v->is_array()) wrong_type(key, kWhole, "array", *v);
    return v;
  }

  [[noreturn]] void wrong_type(std::string_view key, size_t index, const char* expected, const json& found) const {
    fail(ErrorCode::config_type, key,
         fmt::format("{}expected {}, found {}", entry(index), expected, type_name(found)));
  }

  // Integers only: 4096.0 is a float, and a float where an integer belongs is a type error.
  int64_t as_integer(const json& v, std::string_view key, size_t index, int64_t lo, int64_t hi,
                     std::string_view why = {}) const {
    if (!v.is_number_integer()) wrong_type(key, index, "integer", v);
    const bool huge = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxI64);
    const int64_t x = huge ? kMaxI64 : v.get<int64_t>();
    if (huge || x < lo || x > hi)
      fail(ErrorCode::config_value, key,
           fmt::format("{}is {}; {}{}", entry(index), huge ? std::to_string(v.get<uint64_t>()) : std::to_string(x),
                       range_text(lo, hi), why));
    return x;
  }

  const json* object_;
  std::string path_;
  const std::string* source_;
};

// ---------------------------------------------------------------------------------------
// One fact that several keys may state (official and transformers spellings, or a top-level
// key and a nested one). Every key that states it must agree.

struct Yarn {
  bool on = false;
  double factor = 1.0;
  int64_t original_max_position = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool operator==(const Yarn&) const = default;
};

std::string show(int64_t v) { return std::to_string(v); }
std::string show(double v) { return fmt::format("{}", v); }
std::string show(WeightFormat v) { return name(v); }
std::string show(RopeType v) { return std::string(spelling(Names<RopeType>(kRopeTypes), v)); }
std::string show(const Yarn& y) {
  if (!y.on) return "no yarn";
  return fmt::format("yarn factor {} original {} beta {}/{}", y.factor, y.original_max_position,
                     y.beta_fast, y.beta_slow);
}

template <class T>
class Stated {
 public:
  void add(const ErrorContext& where, const std::optional<T>& value) {
    if (!value) return;
    if (value_ && !(*value_ == *value))
      fail(ErrorCode::config_value, where,
           fmt::format("states {} but '{}' states {}", show(*value), where_.field, show(*value_)));
    if (!value_) value_ = value, where_ = where;
  }
  T value_or(T fallback) const { return value_.value_or(fallback); }
  // The key that stated the value, or `fallback_field` for the default.
  ErrorContext where(const Section& top, std::string_view fallback_field) const {
    return value_ ? where_ : top.context(fallback_field);
  }

 private:
  std::optional<T> value_;
  ErrorContext where_;
};

// ---------------------------------------------------------------------------------------
// Parsing, one step per function, in dependency order.

json parse_json(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorCode::config_json, {.file = source}, std::string("malformed JSON: ") + e.what());
  }
  if (!root.is_object())
    fail(ErrorCode::config_json, {.file = source},
         std::string("config.json must be a JSON object, found ") + type_name(root));
  return root;
}

void refuse_unsupported(const json& root, const Section& top) {
  for (const auto& [key, value] : root.items()) {
    if (key.starts_with("dspark_"))
      top.fail(ErrorCode::unsupported_model, key,
               "this is a DSpark multi-stage drafter checkpoint (DeepSeek-V4-Flash-0731 and later): "
               "its mtp.* tensors are a 3-stage DSpark drafter, not the 1-layer MTP of "
               "DeepSeek-V4-Flash, and keel does not run it");
  }
  if (const auto type = top.string("model_type"); type && !lookup(Names<bool>(kModelTypes), *type))
    top.fail(ErrorCode::unsupported_model, "model_type",
             fmt::format("{} is not a DeepSeek-V4 model (expected 'deepseek_v4')", excerpt(*type)));
}

void store(ModelConfig& c, const IntMember& member, int64_t value) {
  if (const auto p = std::get_if<int ModelConfig::*>(&member)) c.**p = static_cast<int>(value);
  if (const auto p = std::get_if<int64_t ModelConfig::*>(&member)) c.**p = value;
}

int64_t load(const ModelConfig& c, const IntKey& k) {
  if (const auto p = std::get_if<int ModelConfig::*>(&k.member)) return c.**p;
  if (const auto p = std::get_if<int64_t ModelConfig::*>(&k.member)) return c.**p;
  return k.fallback;
}

void read_scalars(const Section& top, ModelConfig& c) {
  for (const IntKey& k : kIntKeys) {
    if (k.need == Need::required && !top.find(k.key))
      top.fail(ErrorCode::config_missing, k.key, "required key is absent");
    const int64_t absent = k.need == Need::csa ? 0 : k.fallback;  // csa 0: checked with the schedule
    store(c, k.member, top.integer(k.key, k.lo, k.hi, k.why).value_or(absent));
  }
  for (const RealKey& k : kRealKeys) {
    const double value = top.number(k.key).value_or(k.fallback);
    top.require(k.lo_open ? value > k.lo : value >= k.lo, k.key,
                fmt::format("is {}; must be {} {}", value, k.lo_open ? ">" : ">=", k.lo));
    c.*k.member = value;
  }
  c.scoring_func = top.choice("scoring_func", kScoringFuncs,
                              " (softmax is not supported: transformers 5.17 cannot build it, and "
                              "DeepSeek-V4 uses sqrtsoftplus)")
                       .value_or(kDefaults.scoring_func);
  c.tie_word_embeddings = top.boolean("tie_word_embeddings").value_or(kDefaults.tie_word_embeddings);
}

void check_dimensions(const Section& top, const ModelConfig& c) {
  top.require(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
              fmt::format("is {}; exceeds n_routed_experts {}", c.num_experts_per_tok, c.n_routed_experts));
  top.require(c.num_attention_heads % c.o_groups == 0, "o_groups",
              fmt::format("num_attention_heads {} is not divisible by o_groups {}", c.num_attention_heads,
                          c.o_groups));
  top.require(c.bos_token_id < c.vocab_size, "bos_token_id",
              fmt::format("is {}; must be below vocab_size {}", c.bos_token_id, c.vocab_size));
  top.require(c.eos_token_id < c.vocab_size, "eos_token_id",
              fmt::format("is {}; must be below vocab_size {}", c.eos_token_id, c.vocab_size));
  // An MTP stack deeper than the trunk is nonsense, and the bound keeps schedules small.
  top.require(c.num_nextn_predict_layers <= c.num_hidden_layers, "num_nextn_predict_layers",
              fmt::format("is {}; must not exceed num_hidden_layers {}", c.num_nextn_predict_layers,
                          c.num_hidden_layers));
}

// rope_parameters is either flat (one set of yarn keys, transformers' input form) or nested
// {"main": {...}, "compress": {...}} (what transformers writes back).
struct RopeSections {
  std::optional<Section> flat, main, compress;
};

RopeSections rope_sections(const Section& top) {
  const auto rp = top.section("rope_parameters");
  if (!rp) return {};
  auto main = rp->section("main");
  auto compress = rp->section("compress");
  if (!main && !compress) return {.flat = rp};
  const char* both = "nested rope_parameters needs both main and compress";
  if (!main) rp->fail(ErrorCode::config_missing, "main", both);
  if (!compress) rp->fail(ErrorCode::config_missing, "compress", both);
  return {.main = main, .compress = compress};
}

// rd = int(head_dim * partial_rotary_factor), truncating like Python's int().
std::optional<int64_t> rope_dim_from_factor(const Section& s, int64_t head_dim) {
  const auto factor = s.number("partial_rotary_factor");
  if (!factor) return std::nullopt;
  s.require(*factor > 0 && *factor <= 1, "partial_rotary_factor",
            fmt::format("is {}; must be in (0, 1]", *factor));
  return static_cast<int64_t>(static_cast<double>(head_dim) * *factor);
}

void derive_rope_dim(const Section& top, const RopeSections& rp, ModelConfig& c) {
  Stated<int64_t> rd;
  rd.add(top.context("qk_rope_head_dim"), top.integer("qk_rope_head_dim", 1, kMaxDim));
  for (const auto& s : {std::optional(top), rp.flat, rp.main, rp.compress})
    if (s) rd.add(s->context("partial_rotary_factor"), rope_dim_from_factor(*s, c.head_dim));
  const int64_t value = rd.value_or(static_cast<int64_t>(c.head_dim * kDefaults.partial_rotary_factor));
  if (value <= 0 || value % 2 != 0 || value > c.head_dim)
    fail(ErrorCode::config_value, rd.where(top, "qk_rope_head_dim"),
         fmt::format("rope dim {} must be positive, even and at most head_dim {}", value, c.head_dim));
  c.rope_dim = static_cast<int>(value);
}

void derive_compress_rates(const Section& top, ModelConfig& c) {
  Stated<int64_t> csa, hca;
  csa.add(top.context("compress_rate_csa"), top.integer("compress_rate_csa", 1, kMaxDim));
  hca.add(top.context("compress_rate_hca"), top.integer("compress_rate_hca", 1, kMaxDim));
  if (const auto rates = top.section("compress_rates")) {
    const std::pair<Stated<int64_t>*, const char*> keys[] = {{&csa, "compressed_sparse_attention"},
                                                             {&hca, "heavily_compressed_attention"}};
    for (const auto& [rate, key] : keys)
      rate->add(rates->context(key), rates->integer(key, 1, kMaxDim));
  }
  c.compress_ratio_csa = static_cast<int>(csa.value_or(kDefaults.compress_rate_csa));
  c.compress_ratio_hca = static_cast<int>(hca.value_or(kDefaults.compress_rate_hca));
  if (c.compress_ratio_csa == c.compress_ratio_hca)
    fail(ErrorCode::config_value, hca.where(top, "compress_rate_hca"),
         fmt::format("CSA and HCA compress rates are both {}; a ratio must name one layer type",
                     c.compress_ratio_csa));
}

// An error about one layer of a per-layer list; `key` names the list, the message the layer.
[[noreturn]] void fail_layer(const Section& top, std::string_view key, size_t index, const ModelConfig& c,
                             const std::string& what) {
  const auto n = static_cast<size_t>(c.num_hidden_layers);
  const std::string layer =
      index < n ? fmt::format("layer {}", index) : fmt::format("layer {} (MTP {})", index, index - n);
  top.fail(ErrorCode::config_value, key, layer + ": " + what);
}

// A per-layer list has num_hidden_layers entries, or one more per MTP layer at the end.
void check_length(const Section& top, std::string_view key, size_t size, const ModelConfig& c) {
  const auto n = static_cast<size_t>(c.num_hidden_layers);
  const size_t all = n + static_cast<size_t>(c.num_nextn_predict_layers);
  top.require(size == n || size == all, key,
              fmt::format("has {} entries; expected {} (num_hidden_layers) or {} (with the {} MTP layers)",
                          size, n, all, c.num_nextn_predict_layers));
}

using Schedule = std::vector<AttentionKind>;

std::optional<Schedule> schedule_from_ratios(const Section& top, const ModelConfig& c) {
  const auto ratios = top.integers("compress_ratios", kMinI64, kMaxI64);
  if (!ratios) return std::nullopt;
  check_length(top, "compress_ratios", ratios->size(), c);
  const std::pair<int64_t, AttentionKind> by_ratio[] = {
      {0, AttentionKind::sliding},
      {c.compress_ratio_csa, AttentionKind::compressed_sparse},
      {c.compress_ratio_hca, AttentionKind::heavily_compressed},
  };
  Schedule kinds;
  for (const int64_t r : *ratios) {
    const auto* hit = std::ranges::find(by_ratio, r, &std::pair<int64_t, AttentionKind>::first);
    if (hit == std::end(by_ratio))
      fail_layer(top, "compress_ratios", kinds.size(), c,
                 fmt::format("ratio {} is none of 0 (sliding), {} (CSA), {} (HCA)", r, c.compress_ratio_csa,
                             c.compress_ratio_hca));
    kinds.push_back(hit->second);
  }
  return kinds;
}

std::optional<Schedule> schedule_from_layer_types(const Section& top, const ModelConfig& c) {
  const auto types = top.strings("layer_types");
  if (!types) return std::nullopt;
  check_length(top, "layer_types", types->size(), c);
  Schedule kinds;
  for (const std::string& t : *types) {
    const auto kind = lookup(Names<AttentionKind>(kLayerTypes), t);
    if (!kind)
      fail_layer(top, "layer_types", kinds.size(), c,
                 fmt::format("unknown layer type {} (expected {})", excerpt(t),
                             listing(Names<AttentionKind>(kLayerTypes))));
    kinds.push_back(*kind);
  }
  return kinds;
}

// compress_ratios (official) and layer_types (transformers); with both, they must agree
// where both speak. MTP layers a list leaves out are sliding.
void derive_attention(const Section& top, ModelConfig& c) {
  const auto ratios = schedule_from_ratios(top, c);
  const auto types = schedule_from_layer_types(top, c);
  if (!ratios && !types)
    top.fail(ErrorCode::config_missing, "compress_ratios",
             "no attention schedule: give compress_ratios (official) or layer_types (transformers)");
  if (ratios && types) {
    const auto common = std::min(ratios->size(), types->size());
    for (size_t i = 0; i < common; ++i)
      if ((*ratios)[i] != (*types)[i])
        fail_layer(top, "layer_types", i, c,
                   fmt::format("{} here but {} in compress_ratios", name((*types)[i]), name((*ratios)[i])));
  }
  const Schedule& longest = !types || (ratios && ratios->size() > types->size()) ? *ratios : *types;
  c.attention = longest;
  c.attention.resize(static_cast<size_t>(c.num_layers_with_mtp()), AttentionKind::sliding);
}

// The number of leading hash_moe layers that mlp_layer_types states. Hash layers must come
// first (the official format only has num_hash_layers), and MTP layers are always moe.
std::optional<int64_t> hash_layers_from_types(const Section& top, const ModelConfig& c) {
  const auto types = top.strings("mlp_layer_types");
  if (!types) return std::nullopt;
  check_length(top, "mlp_layer_types", types->size(), c);
  int64_t hash = 0;
  for (size_t i = 0; i < types->size(); ++i) {
    const auto kind = lookup(Names<MlpKind>(kMlpTypes), (*types)[i]);
    if (!kind)
      fail_layer(top, "mlp_layer_types", i, c,
                 fmt::format("unknown mlp type {} (expected {})", excerpt((*types)[i]),
                             listing(Names<MlpKind>(kMlpTypes))));
    if (*kind != MlpKind::hash_moe) continue;
    if (i >= static_cast<size_t>(c.num_hidden_layers))
      fail_layer(top, "mlp_layer_types", i, c, "MTP layers are always moe");
    if (static_cast<int64_t>(i) != hash)
      fail_layer(top, "mlp_layer_types", i, c, "hash_moe after a moe layer; hash layers must come first");
    ++hash;
  }
  return hash;
}

void derive_mlp(const Section& top, ModelConfig& c) {
  const int64_t n = c.num_hidden_layers;
  Stated<int64_t> hash;
  // Like transformers, more hash layers than layers means all of them.
  const auto official = top.integer("num_hash_layers", 0, kMaxDim);
  hash.add(top.context("num_hash_layers"), official ? std::optional(std::min(*official, n)) : std::nullopt);
  hash.add(top.context("mlp_layer_types"), hash_layers_from_types(top, c));
  const auto count = static_cast<size_t>(hash.value_or(std::min(kDefaults.num_hash_layers, n)));
  c.mlp.assign(static_cast<size_t>(c.num_layers_with_mtp()), MlpKind::moe);
  std::fill_n(c.mlp.begin(), count, MlpKind::hash_moe);
}

// The rope type of one rope dict: "type" (official rope_scaling) or "rope_type".
Stated<RopeType> rope_type(const Section& s) {
  Stated<RopeType> type;
  type.add(s.context("type"), s.choice("type", kRopeTypes));
  type.add(s.context("rope_type"), s.choice("rope_type", kRopeTypes));
  return type;
}

std::optional<double> theta(const Section& s, std::string_view key) {
  const auto value = s.number(key);
  if (value) s.require(*value > 1, key, fmt::format("is {}; must be > 1", *value));
  return value;
}

// The YaRN fields of one rope dict. The attention factor is fixed at 1.0: DeepSeek-V4 does
// not scale cos/sin, and keel implements no other value.
Yarn read_yarn(const Section& s, int64_t max_position) {
  if (rope_type(s).value_or(RopeType::plain) != RopeType::yarn) return {};
  const auto factor = s.number("factor");
  if (!factor) s.fail(ErrorCode::config_missing, "factor", "yarn needs a factor");
  s.require(*factor >= 1, "factor", fmt::format("is {}; must be >= 1", *factor));
  const Yarn y{
      .on = true,
      .factor = *factor,
      .original_max_position = s.integer("original_max_position_embeddings", 1, kMaxI64).value_or(max_position),
      .beta_fast = s.number("beta_fast").value_or(kDefaults.yarn_beta_fast),
      .beta_slow = s.number("beta_slow").value_or(kDefaults.yarn_beta_slow),
  };
  s.require(y.beta_fast > 0, "beta_fast", fmt::format("is {}; must be > 0", y.beta_fast));
  s.require(y.beta_slow > 0, "beta_slow", fmt::format("is {}; must be > 0", y.beta_slow));
  const double attention_factor = s.number("attention_factor").value_or(1.0);
  s.require(attention_factor == 1.0, "attention_factor",
            fmt::format("is {}; DeepSeek-V4 uses 1.0 (no YaRN scaling of cos/sin)", attention_factor));
  return y;
}

// Main rope (sliding layers): plain, rope_theta. Compress rope (CSA/HCA layers):
// compress_rope_theta with YaRN from rope_scaling (official) or rope_parameters.
void derive_ropes(const Section& top, const RopeSections& rp, ModelConfig& c) {
  Stated<double> main_theta, compress_theta;
  Stated<Yarn> yarn;
  main_theta.add(top.context("rope_theta"), theta(top, "rope_theta"));
  compress_theta.add(top.context("compress_rope_theta"), theta(top, "compress_rope_theta"));
  if (const auto scaling = top.section("rope_scaling"))
    yarn.add(scaling->context(), read_yarn(*scaling, c.max_position_embeddings));
  if (rp.flat) {
    main_theta.add(rp.flat->context("rope_theta"), theta(*rp.flat, "rope_theta"));
    yarn.add(rp.flat->context(), read_yarn(*rp.flat, c.max_position_embeddings));
  }
  if (rp.main) {
    const auto type = rope_type(*rp.main);
    if (type.value_or(RopeType::plain) != RopeType::plain)
      fail(ErrorCode::config_value, type.where(*rp.main, "rope_type"), "the main rope is plain ('default')");
    main_theta.add(rp.main->context("rope_theta"), theta(*rp.main, "rope_theta"));
  }
  if (rp.compress) {
    compress_theta.add(rp.compress->context("rope_theta"), theta(*rp.compress, "rope_theta"));
    yarn.add(rp.compress->context(), read_yarn(*rp.compress, c.max_position_embeddings));
  }
  c.rope_main = {.theta = main_theta.value_or(kDefaults.rope_theta), .rope_dim = c.rope_dim};
  const Yarn y = yarn.value_or({});
  c.rope_compress = {
      .theta = compress_theta.value_or(kDefaults.compress_rope_theta),
      .rope_dim = c.rope_dim,
      .yarn = y.on,
      .yarn_factor = y.factor,
      .yarn_original_max_position = y.original_max_position,
      .yarn_beta_fast = y.beta_fast,
      .yarn_beta_slow = y.beta_slow,
  };
}

// Reads quantization_config into the FP8 fields; returns whether the experts are NVFP4.
bool read_quantization(const Section& q, ModelConfig& c) {
  const auto method = q.choice("quant_method", kQuantMethods);
  if (!method) q.fail(ErrorCode::config_missing, "quant_method", "required key is absent");
  q.choice("fmt", kFp8Fmts);
  q.choice("activation_scheme", kActivationSchemes);
  c.dense_format = WeightFormat::fp8_block;
  c.fp8_scales_ue8m0 = q.choice("scale_fmt", kScaleFmts).has_value();
  if (const auto block = q.integers("weight_block_size", 1, kMaxDim)) {
    q.require(block->size() == 2, "weight_block_size",
              fmt::format("has {} entries; expected [rows, cols]", block->size()));
    c.fp8_block_rows = static_cast<int>((*block)[0]);
    c.fp8_block_cols = static_cast<int>((*block)[1]);
  }
  const bool nvfp4 = q.choice("moe_quant_algo", kMoeQuantAlgos).has_value();
  if (*method != QuantMethod::modelopt) return nvfp4;
  const auto algo = q.choice("quant_algo", kModeloptAlgos);
  if (!algo) q.fail(ErrorCode::config_missing, "quant_algo", "modelopt needs quant_algo");
  q.require(*algo == ModeloptAlgo::nvfp4 || nvfp4, "quant_algo",
            "MIXED_PRECISION is supported only with moe_quant_algo 'NVFP4'");
  return true;
}

void derive_formats(const Section& top, ModelConfig& c) {
  Stated<WeightFormat> plain;  // the float type of unquantized weights
  plain.add(top.context("torch_dtype"), top.choice("torch_dtype", kFloatDtypes));
  plain.add(top.context("dtype"), top.choice("dtype", kFloatDtypes));
  c.dense_format = plain.value_or(kDefaults.float_format);
  c.fp8_scales_ue8m0 = false;
  c.fp8_block_rows = c.fp8_block_cols = 128;
  const auto quant = top.section("quantization_config");
  const bool nvfp4 = quant && read_quantization(*quant, c);
  const auto expert = top.choice("expert_dtype", kExpertDtypes);
  if (nvfp4)
    top.require(expert.value_or(WeightFormat::mxfp4) == WeightFormat::mxfp4, "expert_dtype",
                "is 'fp8' but quantization_config says the experts are NVFP4");
  c.expert_format = nvfp4 ? WeightFormat::nvfp4 : expert.value_or(c.dense_format);
}

// Checks that need the schedule and the formats.
void check_layers(const Section& top, const ModelConfig& c) {
  if (std::ranges::count(c.attention, AttentionKind::compressed_sparse) > 0) {
    for (const IntKey& k : kIntKeys)
      if (k.need == Need::csa && load(c, k) == 0)
        top.fail(ErrorCode::config_missing, k.key, "required when there are CSA layers");
    top.require(c.index_head_dim >= c.rope_dim, "index_head_dim",
                fmt::format("is {}; the indexer ropes its last {} channels", c.index_head_dim, c.rope_dim));
  }
  // FP4 experts pack pairs with one scale per block along each input dimension.
  const std::pair<WeightFormat, int> fp4_blocks[] = {{WeightFormat::mxfp4, 32}, {WeightFormat::nvfp4, 16}};
  for (const auto& [format, block] : fp4_blocks) {
    if (c.expert_format != format) continue;
    const std::pair<const char*, int64_t> inputs[] = {{"hidden_size", c.hidden_size},
                                                      {"moe_intermediate_size", c.moe_intermediate_size}};
    for (const auto& [key, dim] : inputs)
      top.require(dim % block == 0, key,
                  fmt::format("is {}; {} experts need a multiple of {}", dim, name(format), block));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------

const char* name(AttentionKind kind) {
  static constexpr const char* kNames[] = {"sliding", "compressed_sparse", "heavily_compressed"};
  return kNames[static_cast<size_t>(kind)];
}

const char* name(MlpKind kind) {
  static constexpr const char* kNames[] = {"hash_moe", "moe"};
  return kNames[static_cast<size_t>(kind)];
}

const char* name(WeightFormat format) {
  static constexpr const char* kNames[] = {"bf16", "f32", "fp8_block", "mxfp4", "nvfp4"};
  return kNames[static_cast<size_t>(format)];
}

const char* name(ScoringFunc func) {
  static constexpr const char* kNames[] = {"sqrtsoftplus", "sigmoid"};
  return kNames[static_cast<size_t>(func)];
}

int ModelConfig::compress_ratio(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(attention.size()))
    fail(ErrorCode::usage, {.file = source},
         fmt::format("layer {} out of range (the config has {} layers with MTP)", layer, attention.size()));
  const int ratios[] = {0, compress_ratio_csa, compress_ratio_hca};
  return ratios[static_cast<size_t>(attention[static_cast<size_t>(layer)])];
}

ModelConfig parse_config(const std::string& json_text, const std::string& source) {
  const json root = parse_json(json_text, source);
  const Section top(root, "", source);
  refuse_unsupported(root, top);
  ModelConfig c;
  c.source = source;
  read_scalars(top, c);
  check_dimensions(top, c);
  const RopeSections rp = rope_sections(top);
  derive_rope_dim(top, rp, c);
  derive_ropes(top, rp, c);
  derive_compress_rates(top, c);
  derive_attention(top, c);
  derive_mlp(top, c);
  derive_formats(top, c);
  check_layers(top, c);
  return c;
}

ModelConfig load_config(const std::string& directory) {
  const std::string path = directory + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, {.file = path}, std::string("cannot open: ") + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(ErrorCode::io, {.file = path}, "cannot read");
  return parse_config(text, path);
}

std::string to_official_json(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::ordered_json::array({"DeepseekV4ForCausalLM"});
  j["model_type"] = "deepseek_v4";
  for (const IntKey& k : kIntKeys)
    if (k.need != Need::csa || load(c, k) != 0) j[k.key] = load(c, k);
  for (const RealKey& k : kRealKeys) j[k.key] = c.*k.member;
  j["qk_rope_head_dim"] = c.rope_dim;
  j["scoring_func"] = name(c.scoring_func);
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["num_hash_layers"] = std::ranges::count(c.mlp, MlpKind::hash_moe);
  j["compress_rate_csa"] = c.compress_ratio_csa;
  j["compress_rate_hca"] = c.compress_ratio_hca;
  auto& ratios = j["compress_ratios"] = nlohmann::ordered_json::array();
  for (int i = 0; i < static_cast<int>(c.attention.size()); ++i) ratios.push_back(c.compress_ratio(i));
  j["rope_theta"] = c.rope_main.theta;
  j["compress_rope_theta"] = c.rope_compress.theta;
  if (c.rope_compress.yarn)
    j["rope_scaling"] = {
        {"type", "yarn"},
        {"factor", c.rope_compress.yarn_factor},
        {"original_max_position_embeddings", c.rope_compress.yarn_original_max_position},
        {"beta_fast", c.rope_compress.yarn_beta_fast},
        {"beta_slow", c.rope_compress.yarn_beta_slow},
    };
  j["torch_dtype"] = c.dense_format == WeightFormat::f32 ? "float32" : "bfloat16";
  const std::pair<WeightFormat, const char*> expert_dtypes[] = {
      {WeightFormat::mxfp4, "fp4"}, {WeightFormat::nvfp4, "fp4"}, {WeightFormat::fp8_block, "fp8"}};
  for (const auto& [format, text] : expert_dtypes)
    if (c.expert_format == format) j["expert_dtype"] = text;
  if (c.dense_format == WeightFormat::fp8_block) {
    auto& q = j["quantization_config"] = {
        {"quant_method", "fp8"},
        {"fmt", "e4m3"},
        {"activation_scheme", "dynamic"},
    };
    if (c.fp8_scales_ue8m0) q["scale_fmt"] = "ue8m0";
    q["weight_block_size"] = {c.fp8_block_rows, c.fp8_block_cols};
    if (c.expert_format == WeightFormat::nvfp4) q["moe_quant_algo"] = "NVFP4";
  }
  return j.dump(2) + "\n";
}

std::string describe(const ModelConfig& c) {
  static constexpr char kLetters[] = {'S', 'C', 'H'};  // by AttentionKind
  std::string trunk, mtp;
  for (size_t i = 0; i < c.attention.size(); ++i) {
    std::string& part = i < static_cast<size_t>(c.num_hidden_layers) ? trunk : mtp;
    if (!part.empty()) part += ' ';
    part += kLetters[static_cast<size_t>(c.attention[i])];
  }
  const auto hash = std::ranges::count(c.mlp, MlpKind::hash_moe);
  const RopeConfig& rc = c.rope_compress;
  const std::string yarn =
      rc.yarn ? fmt::format(" yarn x{} (original {}, beta {}/{})", rc.yarn_factor, rc.yarn_original_max_position,
                            rc.yarn_beta_fast, rc.yarn_beta_slow)
              : "";
  const std::string fp8 = fmt::format(" ({}x{} blocks, {} scales)", c.fp8_block_rows, c.fp8_block_cols,
                                      c.fp8_scales_ue8m0 ? "ue8m0" : "f32");
  auto format = [&](WeightFormat f) { return std::string(name(f)) + (f == WeightFormat::fp8_block ? fp8 : ""); };
  std::string s = fmt::format("DeepSeek-V4 config {}\n", c.source);
  s += fmt::format("  shape: vocab {}, hidden {}, {} layers + {} MTP, {} heads x {} (rope {}), q_lora {}, "
                   "o {} groups x {}, window {}\n",
                   c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_nextn_predict_layers,
                   c.num_attention_heads, c.head_dim, c.rope_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank,
                   c.sliding_window);
  s += fmt::format("  attention: {} | mtp: {}   (S sliding, C CSA m={}, H HCA m={}; indexer {} x {}, top {})\n",
                   trunk, mtp.empty() ? "-" : mtp, c.compress_ratio_csa, c.compress_ratio_hca,
                   c.index_n_heads, c.index_head_dim, c.index_topk);
  s += fmt::format("  moe: {} experts, top {} ({}, x{}), {} shared, width {}, {} hash layers, swiglu limit {}\n",
                   c.n_routed_experts, c.num_experts_per_tok, name(c.scoring_func), c.routed_scaling_factor,
                   c.n_shared_experts, c.moe_intermediate_size, hash, c.swiglu_limit);
  s += fmt::format("  mhc: {} streams, {} sinkhorn iterations; rope: main theta {}, compress theta {}{}\n",
                   c.hc_mult, c.hc_sinkhorn_iters, c.rope_main.theta, rc.theta, yarn);
  s += fmt::format("  formats: dense {}, experts {}\n", format(c.dense_format), format(c.expert_format));
  return s;
}

}  // namespace keel
