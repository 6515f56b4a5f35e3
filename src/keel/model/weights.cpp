#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <set>

#include "base/error.h"

namespace keel {
namespace {

constexpr size_t kMaxListedProblems = 40;

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += (s.empty() ? "" : "|") + std::string(traits(d).safetensors_name);
  return s;
}

// Looks tensors up, checks them, and collects every problem instead of stopping.
class Binder {
 public:
  Binder(const Checkpoint& checkpoint, const ModelConfig& config) : ckpt_(checkpoint), config_(config) {}

  // The tensor `name` if it exists with one of `dtypes` and shape `shape`.
  const TensorEntry* find(const std::string& name, std::initializer_list<DType> dtypes, const Shape& shape,
                          const std::string& what) {
    const TensorEntry* e = ckpt_.find(name);
    if (!e) {
      problem("missing " + what + " '" + name + "' (" + dtype_list(dtypes) + " " + to_string(shape) + ")");
      return nullptr;
    }
    used_.insert(name);
    bool ok = true;
    if (std::find(dtypes.begin(), dtypes.end(), e->dtype) == dtypes.end()) {
      problem("'" + name + "': dtype " + std::string(traits(e->dtype).safetensors_name) + ", expected " +
              dtype_list(dtypes));
      ok = false;
    }
    if (e->shape != shape) {
      problem("'" + name + "': shape " + to_string(e->shape) + ", expected " + to_string(shape));
      ok = false;
    }
    return ok ? e : nullptr;
  }

  TensorView view(const TensorEntry& e) const { return ckpt_.view(e.name); }

  // A float tensor (bf16 or f32 as stored).
  bool bind_float(const std::string& name, const TensorSpec& spec, Weight& w) {
    const TensorEntry* e = find(name, {DType::bf16, DType::f32}, spec.shape, keel::name(spec.role));
    if (!e) return false;
    w.format = e->dtype == DType::bf16 ? WeightFormat::bf16 : WeightFormat::f32;
    w.data = view(*e);
    return true;
  }

  // A quantized linear: weight plus scale sidecar (plus global scale for nvfp4).
  bool bind_quantized(const std::string& weight_name, const std::string& scale_name, const TensorSpec& spec,
                      Weight& w) {
    const Shape scales = scale_shape(spec, config_);
    const TensorEntry* data = nullptr;
    const TensorEntry* scale = nullptr;
    switch (spec.format) {
      case WeightFormat::fp8_block:
        data = find(weight_name, {DType::f8_e4m3}, spec.shape, "fp8 weight");
        scale = find(scale_name, {DType::f8_e8m0, DType::f32}, scales, "fp8 block scale");
        if (scale) w.scale_format = scale->dtype == DType::f32 ? ScaleFormat::f32 : ScaleFormat::ue8m0;
        break;
      case WeightFormat::mxfp4:
        data = find(weight_name, {DType::i8, DType::u8}, stored_shape(spec), "mxfp4 weight");
        scale = find(scale_name, {DType::f8_e8m0, DType::u8}, scales, "mxfp4 scale");
        break;
      case WeightFormat::nvfp4: {
        data = find(weight_name, {DType::u8, DType::i8}, stored_shape(spec), "nvfp4 weight");
        scale = find(scale_name, {DType::f8_e4m3}, scales, "nvfp4 block scale");
        const std::string global_name = scale_name + "_2";
        if (const TensorEntry* g = find(global_name, {DType::f32}, {}, "nvfp4 global scale"))
          std::memcpy(&w.global_scale, view(*g).data, sizeof(float));
        break;
      }
      default:
        return false;
    }
    if (!data || !scale) return false;
    w.format = spec.format;
    w.data = view(*data);
    w.scale = view(*scale);
    return true;
  }

  void problem(std::string text) { problems_.push_back(std::move(text)); }
  const std::vector<std::string>& problems() const { return problems_; }
  const std::set<std::string>& used() const { return used_; }

 private:
  const Checkpoint& ckpt_;
  const ModelConfig& config_;
  std::vector<std::string> problems_;
  std::set<std::string> used_;
};

bool is_float(WeightFormat f) { return f == WeightFormat::bf16 || f == WeightFormat::f32; }

std::string replace_suffix(const std::string& name, const std::string& from, const std::string& to) {
  return name.substr(0, name.size() - from.size()) + to;
}

bool bind_official(Binder& b, const TensorSpec& spec, Weight& w) {
  if (spec.role == TensorRole::table) {
    const TensorEntry* e = b.find(spec.name, {DType::i64, DType::i32}, spec.shape, "table");
    if (e) w.data = b.view(*e);
    return e != nullptr;
  }
  if (spec.role != TensorRole::linear || is_float(spec.format)) return b.bind_float(spec.name, spec, w);
  // Official sidecars: "X.scale"; NVIDIA's NVFP4 re-quants use ModelOpt's
  // "X.weight_scale" / "X.weight_scale_2".
  const std::string scale = spec.format == WeightFormat::nvfp4 ? replace_suffix(spec.name, "weight", "weight_scale")
                                                               : replace_suffix(spec.name, "weight", "scale");
  return b.bind_quantized(spec.name, scale, spec, w);
}

// transformers stores a layer's routed experts fused; the weight is a slice of them.
bool bind_fused_expert(Binder& b, const ModelConfig& c, const ExpertName& x, const TensorSpec& spec, Weight& w) {
  if (!is_float(spec.format)) {
    b.problem("'" + spec.name + "': quantized routed experts in transformers naming are not supported");
    return false;
  }
  const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, D = c.hidden_size;
  const bool down = x.which == 2;
  const std::string fused = down ? transformers_down(x.layer) : transformers_gate_up(x.layer);
  const Shape fused_shape = down ? Shape{E, D, I} : Shape{E, 2 * I, D};
  const TensorEntry* e = b.find(fused, {DType::bf16, DType::f32}, fused_shape, "fused experts");
  if (!e) return false;
  const int64_t rows_before = down ? x.expert * D : x.expert * 2 * I + (x.which == 3 ? I : 0);
  const int64_t row_width = down ? I : D;
  const auto* base = static_cast<const std::byte*>(b.view(*e).data);
  const uint64_t offset = static_cast<uint64_t>(rows_before * row_width) * (bits(e->dtype) / 8);
  w.format = e->dtype == DType::bf16 ? WeightFormat::bf16 : WeightFormat::f32;
  w.data = TensorView::contiguous(base + offset, e->dtype, spec.shape, Memory::mapped);
  return true;
}

bool bind_transformers(Binder& b, const ModelConfig& c, const TensorSpec& spec, Weight& w) {
  if (auto expert = parse_expert_name(spec.name)) return bind_fused_expert(b, c, *expert, spec, w);
  const auto hf = transformers_name(spec.name);
  if (!hf) {
    b.problem("'" + spec.name + "' has no transformers name");
    return false;
  }
  TensorSpec renamed = spec;
  renamed.name = *hf;
  if (spec.role != TensorRole::linear || is_float(spec.format)) return bind_official(b, renamed, w);
  // transformers' FP8 integration names the sidecar "weight_scale_inv".
  return b.bind_quantized(*hf, replace_suffix(*hf, "weight", "weight_scale_inv"), spec, w);
}

}  // namespace

ModelWeights ModelWeights::bind(const Checkpoint& checkpoint, const ModelConfig& config) {
  ModelWeights mw;
  mw.specs_ = expected_tensors(config);
  mw.naming_ = detect_naming(checkpoint);
  mw.has_mtp_ = mw.naming_ == Naming::official && config.num_nextn_predict_layers > 0;
  Binder b(checkpoint, config);
  for (const TensorSpec& spec : mw.specs_) {
    if (spec.layer >= config.num_hidden_layers && !mw.has_mtp_) continue;
    Weight w;
    w.spec = &spec;
    const bool ok = mw.naming_ == Naming::official ? bind_official(b, spec, w) : bind_transformers(b, config, spec, w);
    if (ok) mw.weights_.emplace(spec.name, std::move(w));
  }
  if (!b.problems().empty()) {
    const auto& all = b.problems();
    std::vector<std::string> listed(all.begin(), all.begin() + std::min(all.size(), kMaxListedProblems));
    if (all.size() > listed.size()) listed.push_back("... and " + std::to_string(all.size() - listed.size()) + " more");
    fail(ErrorCode::weights_mismatch, {.file = checkpoint.directory()},
         std::to_string(all.size()) + " tensor(s) missing or mismatched for " + name(mw.naming_) +
             " naming of the config in " + config.source,
         std::move(listed));
  }
  for (const auto& n : checkpoint.names()) {
    if (!b.used().count(n)) mw.unused_.push_back(n);
  }
  for (const auto& [n, w] : mw.weights_) mw.stored_bytes_ += w.data.nbytes() + (w.scale.data ? w.scale.nbytes() : 0);
  return mw;
}

const Weight& ModelWeights::at(const std::string& official_name) const {
  auto it = weights_.find(official_name);
  if (it == weights_.end()) fail(ErrorCode::missing_tensor, {.tensor = official_name}, "no such weight is bound");
  return it->second;
}

}  // namespace keel
