// The native model's construction by name, its checks, and its registration as torch.classes.specchat.NativeModel
// (model.h says what it is; model_forward.cpp runs the pass).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "model.h"

namespace specchat {
namespace {

const std::map<std::string, LayerMatrix> kMatrices = {
    {"q", LayerMatrix::Q},       {"k", LayerMatrix::K},       {"v", LayerMatrix::V},   {"qkv", LayerMatrix::QKV},
    {"o", LayerMatrix::O},       {"gate", LayerMatrix::Gate}, {"up", LayerMatrix::Up}, {"gate_up", LayerMatrix::GateUp},
    {"down", LayerMatrix::Down},
};
const std::map<std::string, LayerVector> kVectors = {
    {"attn_norm", LayerVector::AttnNorm},
    {"ffn_norm", LayerVector::FfnNorm},
    {"post_attn_norm", LayerVector::PostAttnNorm},
    {"post_ffn_norm", LayerVector::PostFfnNorm},
    {"q_norm", LayerVector::QNorm},
    {"k_norm", LayerVector::KNorm},
    {"q_bias", LayerVector::QBias},
    {"k_bias", LayerVector::KBias},
    {"v_bias", LayerVector::VBias},
};
const char* kSettings[] = {"hidden",       "heads",         "kv_heads",     "head_dim",    "rot_dim",
                           "inter",        "vocab",         "eps",          "embed_scale", "attn_scale",
                           "attn_softcap", "final_softcap", "norm_add_one", "act",         "profile"};

template <class M>
std::string names(const M& map) {
  std::string out;
  for (const auto& [name, _] : map) out += (out.empty() ? "" : ", ") + name;
  return out;
}

Layer& layer_at(std::vector<Layer>& layers, int64_t index) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(layers.size()), "NativeModel: no layer ", index, " (",
              layers.size(), " added)");
  return layers[static_cast<size_t>(index)];
}

std::vector<float> floats(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(t.dim() == 1 && t.is_floating_point() && t.device().is_cpu(), "NativeModel: ", what,
              " must be a 1-D float CPU tensor, got ", t.sizes(), " ", t.scalar_type());
  const at::Tensor f = t.to(at::kFloat).contiguous();
  const float* p = f.const_data_ptr<float>();
  return std::vector<float>(p, p + f.numel());
}

// Weights arrive as Any (c10::IValue), not as QWeight in the methods' schemas: a schema naming QWeight could
// only be registered after QWeight's own registration, an order between translation units nothing fixes.
c10::intrusive_ptr<QWeight> as_qweight(const c10::IValue& value, const std::string& name) {
  TORCH_CHECK(value.isObject(), "NativeModel: weight '", name, "' must be a torch.classes.specchat.QWeight, got ",
              value.tagKind());
  return value.toCustomClass<QWeight>();
}

}  // namespace

void NativeModel::set(const std::string& name, const c10::IValue& value) {
  bool known = false;
  for (const char* s : kSettings) known = known || name == s;
  TORCH_CHECK(known, "NativeModel.set: unknown setting '", name, "'");
  TORCH_CHECK(value.isInt() || value.isDouble() || value.isBool() || value.isString(), "NativeModel.set('", name,
              "'): a number or a string, got ", value.tagKind());
  if (name == "profile") {
    profiling = value.isBool() ? value.toBool() : value.toScalar().toDouble() != 0;
    return;
  }
  settings[name] = value;
  finished = false;
}

c10::IValue NativeModel::get(const std::string& name) const {
  if (name == "layers") return static_cast<int64_t>(layers.size());
  if (name == "profile") return profiling;
  auto found = settings.find(name);
  TORCH_CHECK(found != settings.end(), "NativeModel.get: '", name, "' is not set");
  return found->second;
}

void NativeModel::set_weight(const std::string& name, const c10::IValue& weight) {
  TORCH_CHECK(name == "embed" || name == "head", "NativeModel.set_weight: '", name, "' is not embed or head");
  (name == "embed" ? embed : head) = as_qweight(weight, name);
  finished = false;
}

void NativeModel::set_tensor(const std::string& name, const at::Tensor& value) {
  TORCH_CHECK(name == "final_norm", "NativeModel.set_tensor: '", name, "' is not final_norm");
  final_norm_in = value;
  finished = false;
}

int64_t NativeModel::add_layer() {
  layers.emplace_back();
  finished = false;
  return static_cast<int64_t>(layers.size()) - 1;
}

void NativeModel::set_layer(int64_t layer, const std::string& name, int64_t value) {
  Layer& l = layer_at(layers, layer);
  if (name == "window") {
    TORCH_CHECK(value == -1 || value >= 1, "NativeModel: layer ", layer, " window ", value, " (-1 or >= 1)");
    l.window = value;
  } else if (name == "rope") {
    l.rope = value;
  } else {
    TORCH_CHECK(false, "NativeModel.set_layer: unknown setting '", name, "' (window, rope)");
  }
  finished = false;
}

void NativeModel::set_layer_weight(int64_t layer, const std::string& name, const c10::IValue& weight) {
  auto found = kMatrices.find(name);
  TORCH_CHECK(found != kMatrices.end(), "NativeModel.set_layer_weight: unknown weight '", name, "' (", names(kMatrices),
              ")");
  layer_at(layers, layer).matrices[static_cast<size_t>(found->second)] = as_qweight(weight, name);
  finished = false;
}

void NativeModel::set_layer_tensor(int64_t layer, const std::string& name, const at::Tensor& value) {
  auto found = kVectors.find(name);
  TORCH_CHECK(found != kVectors.end(), "NativeModel.set_layer_tensor: unknown tensor '", name, "' (", names(kVectors),
              ")");
  floats(value, name);  // checked now, converted by finish()
  layer_at(layers, layer).vectors[static_cast<size_t>(found->second)] = value;
  finished = false;
}

int64_t NativeModel::add_rope(const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "NativeModel.add_rope: cos and sin must be [positions, "
              "rot_dim / 2] alike, got ",
              cos.sizes(), " and ", sin.sizes());
  Rope rope;
  rope.positions = cos.size(0);
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  rope.cos.assign(c.const_data_ptr<float>(), c.const_data_ptr<float>() + c.numel());
  rope.sin.assign(s.const_data_ptr<float>(), s.const_data_ptr<float>() + s.numel());
  ropes.push_back(std::move(rope));
  finished = false;
  return static_cast<int64_t>(ropes.size()) - 1;
}

void NativeModel::bind_cache(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.is_contiguous() &&
                  v.is_contiguous() && k.device().is_cpu(),
              "NativeModel.bind_cache: K and V pools must be contiguous CPU [layers, kv_heads, slots, head_dim] "
              "tensors alike, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat,
              "NativeModel.bind_cache: pools of ", k.scalar_type(), " (float16, bfloat16 or float32 only)");
  k_pool = k;
  v_pool = v;
  finished = false;
}

void NativeModel::check() {
  auto integer = [&](const char* name, int64_t fallback) -> int64_t {
    auto found = settings.find(name);
    if (found == settings.end()) {
      TORCH_CHECK(fallback >= 0, "NativeModel: setting '", name, "' is missing");
      return fallback;
    }
    TORCH_CHECK(found->second.isInt(), "NativeModel: setting '", name, "' must be an integer");
    return found->second.toInt();
  };
  auto real = [&](const char* name, double fallback) -> float {
    auto found = settings.find(name);
    if (found == settings.end()) return static_cast<float>(fallback);
    TORCH_CHECK(found->second.isInt() || found->second.isDouble(), "NativeModel: setting '", name, "' is not a number");
    return static_cast<float>(found->second.toScalar().toDouble());
  };
  Shape s;
  s.hidden = integer("hidden", -1);
  s.heads = integer("heads", -1);
  s.kv_heads = integer("kv_heads", -1);
  s.head_dim = integer("head_dim", -1);
  s.rot_dim = integer("rot_dim", s.head_dim);
  s.inter = integer("inter", -1);
  s.vocab = integer("vocab", -1);
  s.eps = real("eps", 1e-6);
  s.embed_scale = real("embed_scale", 1.0);
  s.attn_scale = real("attn_scale", 1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  s.attn_cap = real("attn_softcap", 0.0);
  s.final_cap = real("final_softcap", 0.0);
  s.norm_add_one = integer("norm_add_one", 0) != 0;
  auto act = settings.find("act");
  const std::string act_name = act == settings.end() ? "silu" : act->second.toStringRef();
  TORCH_CHECK(act_name == "silu" || act_name == "gelu_tanh", "NativeModel: act '", act_name, "' (silu, gelu_tanh)");
  s.gelu = act_name == "gelu_tanh";
  TORCH_CHECK(s.hidden > 0 && s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.head_dim > 0 &&
                  s.inter > 0 && s.vocab > 0 && s.rot_dim > 0 && s.rot_dim <= s.head_dim && s.rot_dim % 2 == 0,
              "NativeModel: inconsistent sizes (hidden ", s.hidden, ", heads ", s.heads, ", kv_heads ", s.kv_heads,
              ", head_dim ", s.head_dim, ", rot_dim ", s.rot_dim, ", inter ", s.inter, ", vocab ", s.vocab, ")");
  TORCH_CHECK(!layers.empty(), "NativeModel: no layers");
  auto expect = [](const QMatrix* m, int64_t rows, int64_t cols, const std::string& what) {
    TORCH_CHECK(m != nullptr, "NativeModel: ", what, " is missing");
    TORCH_CHECK(m->rows() == rows && m->cols() == cols, "NativeModel: ", what, " is ", m->rows(), " x ", m->cols(),
                ", expected ", rows, " x ", cols);
  };
  TORCH_CHECK(embed, "NativeModel: the embedding (set_weight('embed', ...)) is missing");
  expect(&embed->matrix(), s.vocab, s.hidden, "embed");
  expect(head ? &head->matrix() : &embed->matrix(), s.vocab, s.hidden, "head");
  TORCH_CHECK(final_norm_in.defined(), "NativeModel: final_norm is missing");
  auto norm_values = [&](const at::Tensor& t, int64_t size, const std::string& what, bool add_one) {
    std::vector<float> v = floats(t, what);
    TORCH_CHECK(static_cast<int64_t>(v.size()) == size, "NativeModel: ", what, " has ", v.size(), " values, expected ",
                size);
    if (add_one) {
      for (float& x : v) x = 1.0f + x;  // gemma's (1 + w), in float32 as transformers computes it
    }
    return v;
  };
  final_norm = norm_values(final_norm_in, s.hidden, "final_norm", s.norm_add_one);
  const int64_t q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
  for (size_t i = 0; i < layers.size(); ++i) {
    Layer& l = layers[i];
    const std::string at = "layer " + std::to_string(i) + " ";
    if (l.matrix(LayerMatrix::QKV)) {
      expect(l.matrix(LayerMatrix::QKV), q_width + 2 * kv_width, s.hidden, at + "qkv");
    } else {
      expect(l.matrix(LayerMatrix::Q), q_width, s.hidden, at + "q");
      expect(l.matrix(LayerMatrix::K), kv_width, s.hidden, at + "k");
      expect(l.matrix(LayerMatrix::V), kv_width, s.hidden, at + "v");
    }
    expect(l.matrix(LayerMatrix::O), s.hidden, q_width, at + "o");
    if (l.matrix(LayerMatrix::GateUp)) {
      expect(l.matrix(LayerMatrix::GateUp), 2 * s.inter, s.hidden, at + "gate_up");
    } else {
      expect(l.matrix(LayerMatrix::Gate), s.inter, s.hidden, at + "gate");
      expect(l.matrix(LayerMatrix::Up), s.inter, s.hidden, at + "up");
    }
    expect(l.matrix(LayerMatrix::Down), s.hidden, s.inter, at + "down");
    const std::pair<LayerVector, int64_t> sizes[] = {
        {LayerVector::AttnNorm, s.hidden},    {LayerVector::FfnNorm, s.hidden}, {LayerVector::PostAttnNorm, s.hidden},
        {LayerVector::PostFfnNorm, s.hidden}, {LayerVector::QNorm, s.head_dim}, {LayerVector::KNorm, s.head_dim},
        {LayerVector::QBias, q_width},        {LayerVector::KBias, kv_width},   {LayerVector::VBias, kv_width}};
    for (const auto& [which, size] : sizes) {
      const at::Tensor& t = l.vectors[static_cast<size_t>(which)];
      std::string name;
      for (const auto& [n, v] : kVectors) name = v == which ? n : name;
      const bool required = which == LayerVector::AttnNorm || which == LayerVector::FfnNorm;
      TORCH_CHECK(t.defined() || !required, "NativeModel: ", at, name, " is missing");
      const bool norm = which != LayerVector::QBias && which != LayerVector::KBias && which != LayerVector::VBias;
      l.values[static_cast<size_t>(which)] =
          t.defined() ? norm_values(t, size, at + name, norm && s.norm_add_one) : std::vector<float>();
    }
  }
  shape = s;
}

void NativeModel::finish() {
  check();
  const Shape& s = shape;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    TORCH_CHECK(l.rope >= 0 && l.rope < static_cast<int64_t>(ropes.size()), "NativeModel: layer ", i, " rope table ",
                l.rope, " (", ropes.size(), " added)");
    TORCH_CHECK(static_cast<int64_t>(ropes[static_cast<size_t>(l.rope)].cos.size()) ==
                    ropes[static_cast<size_t>(l.rope)].positions * (s.rot_dim / 2),
                "NativeModel: rope table ", l.rope, " is not [positions, rot_dim / 2 = ", s.rot_dim / 2, "]");
  }
  TORCH_CHECK(k_pool.defined(), "NativeModel: no KV cache bound (bind_cache)");
  TORCH_CHECK(k_pool.size(0) == static_cast<int64_t>(layers.size()) && k_pool.size(1) == s.kv_heads &&
                  k_pool.size(3) == s.head_dim,
              "NativeModel: the KV cache is ", k_pool.sizes(), ", expected [", layers.size(), ", ", s.kv_heads,
              ", slots, ", s.head_dim, "]");
  finished = true;
}

c10::Dict<std::string, double> NativeModel::profile() const {
  c10::Dict<std::string, double> out;
  out.insert("kernels", spent.kernels);
  out.insert("attention", spent.attention);
  out.insert("elementwise", spent.elementwise);
  out.insert("passes", static_cast<double>(spent.passes));
  out.insert("rows", static_cast<double>(spent.rows));
  return out;
}

void NativeModel::reset_profile() { spent = Profile(); }

}  // namespace specchat

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.class_<specchat::NativeModel>("NativeModel")
      .def(torch::init<>())
      .def("set", &specchat::NativeModel::set)
      .def("get", &specchat::NativeModel::get)
      .def("set_weight", &specchat::NativeModel::set_weight)
      .def("set_tensor", &specchat::NativeModel::set_tensor)
      .def("add_layer", &specchat::NativeModel::add_layer)
      .def("set_layer", &specchat::NativeModel::set_layer)
      .def("set_layer_weight", &specchat::NativeModel::set_layer_weight)
      .def("set_layer_tensor", &specchat::NativeModel::set_layer_tensor)
      .def("add_rope", &specchat::NativeModel::add_rope)
      .def("bind_cache", &specchat::NativeModel::bind_cache)
      .def("check", &specchat::NativeModel::check)
      .def("finish", &specchat::NativeModel::finish)
      .def("forward", &specchat::NativeModel::forward)
      .def("forward_batch", &specchat::NativeModel::forward_batch)
      .def("profile", &specchat::NativeModel::profile)
      .def("reset_profile", &specchat::NativeModel::reset_profile);
}
