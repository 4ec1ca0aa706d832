// The compact forward's decoder layers for passes of up to 64 tokens, in C++: the same operations, in the same
// order, on the same tensors as backend/kernels/compact.py's Python loop (CompactForward._attention,
// _attend_rows on a contiguous run of cache slots or a tree, _mlp), so each result is the Python loop's bit for
// bit. Kernels, reductions, matrix products, softmax and SiLU are the same ATen calls; the elementwise chains
// between them are exact loops (below). Left out: the Python interpreter and its per-operation argument parsing
// (~1,300 calls a token), and most of the chains' dispatch and temporaries.
// backend/kernels/native.py builds this file with the machine's C++ compiler into a cached library and binds
// a model's tensors to it once (prepare); tests/backend/kernels/test_native.py checks the equality.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace {

// x.to(bfloat16).contiguous() for float32 x (round to nearest even, as ATen converts).
at::Tensor to_bf16(const at::Tensor& x) {
  if (x.scalar_type() != at::kFloat || !x.is_contiguous()) return x.to(at::kBFloat16).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* in = x.const_data_ptr<float>();
  c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t count = x.numel();
  for (int64_t i = 0; i < count; ++i) o[i] = c10::BFloat16(in[i]);
  return out;
}

struct Projection {  // an Int4Linear: quant_linear.kernel_call's call on a 2-D input of at most 160 rows
  at::Tensor packed, scales_zeros;
  std::optional<at::Tensor> bias;
  int64_t group = 0;

  at::Tensor operator()(const at::Tensor& x, at::ScalarType dtype) const {
    const at::Tensor input = dtype == at::kBFloat16 ? to_bf16(x) : x.to(dtype).contiguous();
    at::Tensor out = at::_weight_int4pack_mm_for_cpu(input, packed, group, scales_zeros);
    return bias ? out + *bias : out;
  }
};

struct Layer {
  at::Tensor norm1, norm2, k_pool, v_pool;  // pools: the cache's [1, kv_heads, slots, head_dim] views
  double eps1 = 0, eps2 = 0, scaling = 0;
  Projection qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, inter = 0, window = -1;  // window -1: none
};

struct Model {
  std::vector<Layer> layers;
  at::ScalarType dtype = at::kBFloat16;  // the projections' input dtype
  at::Tensor unused;                       // baddbmm's ignored input, [1, 1, 1] float32
};

// Exact stand-ins for chains of small ATen operations: each element is computed with the same float operations
// in the same order as ATen's kernels do (a product, a sum, a division, a square root, each rounded once; the
// library is built with -ffp-contract=off so no product and sum fuse), so the result is the same bit for bit,
// without the dispatch, type promotion copies and allocations of the chain. Reductions stay ATen's (at::mean):
// their summation order is its own. Inputs they do not cover (other dtypes, layouts) take the ATen chain.

// F.rms_norm(x, [hidden], weight, eps) for float32 x [n, hidden] and weight [hidden] (rms_norm_composite:
// mean(x^2) + eps, rsqrt, x * r, * weight).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t hidden = x.size(1);
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || !x.is_contiguous() ||
      !weight.is_contiguous()) {
    return at::rms_norm(x, {hidden}, weight, eps);
  }
  const int64_t n = x.size(0), count = n * hidden;
  at::Tensor squares = at::empty_like(x);
  const float* in = x.const_data_ptr<float>();
  float* sq = squares.mutable_data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) sq[i] = in[i] * in[i];
  at::Tensor mean = at::mean(squares, {-1}, true);
  const float* m = mean.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  const float eps_val = static_cast<float>(eps);
  at::Tensor out = at::empty_like(x);
  float* o = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float scale = 1.0f / std::sqrt(m[r] + eps_val);
    for (int64_t j = 0; j < hidden; ++j) {
      const float normed = in[r * hidden + j] * scale;
      o[r * hidden + j] = normed * w[j];
    }
  }
  return out;
}

// h.add_(y) for float32 h and bfloat16 y of the same shape, both contiguous.
void add_into(at::Tensor& h, const at::Tensor& y) {
  if (y.scalar_type() != at::kBFloat16 || !y.is_contiguous() || !h.is_contiguous() || y.sizes() != h.sizes()) {
    h.add_(y);
    return;
  }
  float* out = h.mutable_data_ptr<float>();
  const c10::BFloat16* in = y.const_data_ptr<c10::BFloat16>();
  const int64_t count = h.numel();
  for (int64_t i = 0; i < count; ++i) out[i] = out[i] + static_cast<float>(in[i]);
}

// F.silu(gate.float(), inplace=True).mul_(up), for gate and up bfloat16 [n, inter] views of one projection's
// output (rows of the same stride); SiLU is ATen's (its exp is its own), the product exact.
at::Tensor gated(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor act = gate.to(at::kFloat);
  at::silu_(act);
  if (up.scalar_type() != at::kBFloat16 || up.stride(1) != 1 || !act.is_contiguous()) return act.mul_(up);
  const int64_t n = act.size(0), inter = act.size(1), row = up.stride(0);
  float* a = act.mutable_data_ptr<float>();
  const c10::BFloat16* u = up.const_data_ptr<c10::BFloat16>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < inter; ++j) a[r * inter + j] = a[r * inter + j] * static_cast<float>(u[r * row + j]);
  }
  return act;
}

// pool.slice(2, start, start + n).copy_(x) for a bfloat16 cache pool [1, kv_heads, slots, head_dim] (contiguous)
// and x [1, kv_heads, n, head_dim] float32 or bfloat16 with unit stride over head_dim.
void write_slots(const at::Tensor& pool, const at::Tensor& x, int64_t start) {
  const int64_t heads = x.size(1), n = x.size(2), d = x.size(3);
  if (pool.scalar_type() != at::kBFloat16 || !pool.is_contiguous() || x.stride(3) != 1 ||
      (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16)) {
    pool.slice(2, start, start + n).copy_(x);
    return;
  }
  const int64_t slots = pool.size(2);
  c10::BFloat16* out = pool.mutable_data_ptr<c10::BFloat16>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      c10::BFloat16* y = out + (h * slots + start + t) * d;
      const int64_t offset = h * x.stride(1) + t * x.stride(2);
      if (x.scalar_type() == at::kFloat) {
        const float* in = x.const_data_ptr<float>() + offset;
        for (int64_t j = 0; j < d; ++j) y[j] = c10::BFloat16(in[j]);
      } else {
        const c10::BFloat16* in = x.const_data_ptr<c10::BFloat16>() + offset;
        for (int64_t j = 0; j < d; ++j) y[j] = in[j];
      }
    }
  }
}

// qk * cos + qk.roll(d / 2, -1) * signed_sin for qk bfloat16 [1, heads, n, d] (a view of the projection's
// [n, width] output) and cos / signed_sin float32 [1, 1, n, d]; the result float32 in the layout ATen gives it.
at::Tensor rotary(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& signed_sin) {
  const int64_t heads = qk.size(1), n = qk.size(2), d = qk.size(3);
  if (qk.scalar_type() != at::kBFloat16 || qk.stride(3) != 1 || qk.stride(1) != d || !cos.is_contiguous() ||
      !signed_sin.is_contiguous() || cos.scalar_type() != at::kFloat || signed_sin.scalar_type() != at::kFloat) {
    return qk * cos + qk.roll({d / 2}, {-1}) * signed_sin;
  }
  at::Tensor out = at::empty_strided({1, heads, n, d}, {n * heads * d, d, n == 1 ? d : heads * d, 1}, at::kFloat);
  const c10::BFloat16* in = qk.const_data_ptr<c10::BFloat16>();
  const float* c = cos.const_data_ptr<float>();
  const float* s = signed_sin.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t row = qk.stride(2), half = d / 2;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const c10::BFloat16* x = in + t * row + h * d;
      float* y = o + t * heads * d + h * d;
      for (int64_t j = 0; j < d; ++j) {
        const float a = static_cast<float>(x[j]) * c[t * d + j];
        const float b = static_cast<float>(x[(j + half) % d]) * s[t * d + j];
        y[j] = a + b;
      }
    }
  }
  return out;
}

std::mutex models_lock;
std::vector<std::shared_ptr<Model>> models;

constexpr int64_t kTensors = 16, kInts = 9, kFloats = 3;  // per layer, in prepare's order

int64_t prepare(const std::vector<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& ints,
                const std::vector<double>& floats, at::ScalarType dtype) {
  const int64_t count = static_cast<int64_t>(ints.size()) / kInts;
  TORCH_CHECK(count * kInts == static_cast<int64_t>(ints.size()) &&
                  count * kTensors == static_cast<int64_t>(tensors.size()) &&
                  count * kFloats == static_cast<int64_t>(floats.size()),
              "specchat_native.prepare: ", tensors.size(), " tensors, ", ints.size(), " ints and ", floats.size(),
              " floats are not whole layers");
  auto model = std::make_shared<Model>();
  model->dtype = dtype;
  model->unused = at::zeros({1, 1, 1}, at::kFloat);
  auto need = [&](int64_t i) {
    TORCH_CHECK(tensors[i].has_value(), "specchat_native.prepare: tensor ", i, " is missing");
    return *tensors[i];
  };
  for (int64_t l = 0; l < count; ++l) {
    const int64_t t = l * kTensors, n = l * kInts, f = l * kFloats;
    Layer layer;
    layer.norm1 = need(t);
    layer.norm2 = need(t + 1);
    Projection* projections[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int64_t p = 0; p < 4; ++p) {
      projections[p]->packed = need(t + 2 + 3 * p);
      projections[p]->scales_zeros = need(t + 3 + 3 * p);
      projections[p]->bias = tensors[t + 4 + 3 * p];
      projections[p]->group = ints[n + p];
    }
    layer.k_pool = need(t + 14);
    layer.v_pool = need(t + 15);
    layer.heads = ints[n + 4];
    layer.kv_heads = ints[n + 5];
    layer.head_dim = ints[n + 6];
    layer.inter = ints[n + 7];
    layer.window = ints[n + 8];
    layer.eps1 = floats[f];
    layer.eps2 = floats[f + 1];
    layer.scaling = floats[f + 2];
    model->layers.push_back(std::move(layer));
  }
  std::lock_guard<std::mutex> guard(models_lock);
  models.push_back(std::move(model));
  return static_cast<int64_t>(models.size()) - 1;
}

void release(int64_t handle) {
  std::lock_guard<std::mutex> guard(models_lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(models.size()), "specchat_native: no model ", handle);
  models[handle].reset();
}

// _attend_rows for a pass whose new tokens' slots and whose keys' slots are each one consecutive run; ``tree``
// (a tree of drafts, no sliding window in effect): per new token, the indices of the keys it attends.
at::Tensor attend_rows(const Model& model, const Layer& layer, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, int64_t start, int64_t write_start, int64_t read_start, int64_t kv_len,
                       const std::vector<at::Tensor>& tree) {
  const int64_t n = q.size(2), d = layer.head_dim, q_width = layer.heads * d;
  write_slots(layer.k_pool, k, write_start);
  write_slots(layer.v_pool, v, write_start);
  const bool windowed = layer.window >= 0 && layer.window < kv_len;
  const int64_t first = windowed ? std::max<int64_t>(0, start - layer.window + 1) : 0;
  at::Tensor keys = layer.k_pool.slice(2, read_start + first, read_start + kv_len).select(0, 0).to(q.scalar_type());
  at::Tensor values =
      layer.v_pool.slice(2, read_start + first, read_start + kv_len).select(0, 0).to(q.scalar_type());
  at::Tensor keys_t = keys.transpose(1, 2);
  const int64_t rep = layer.heads / layer.kv_heads;
  at::Tensor queries = q.select(0, 0).transpose(0, 1).reshape({n, layer.kv_heads, rep, d});
  std::vector<at::Tensor> rows;
  rows.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor key_t = keys_t, value = values;
    if (!tree.empty()) {  // keys[:, tree[i]] in Python: a slice, then an index by the tensor
      c10::List<std::optional<at::Tensor>> index;
      index.push_back(std::nullopt);
      index.push_back(tree[i]);
      key_t = at::index(keys, index).transpose(1, 2);
      value = at::index(values, index);
    } else if (!(n == 1 && !windowed)) {
      const int64_t position = start + i;
      const int64_t low = windowed ? std::max<int64_t>(0, position - layer.window + 1) - first : 0;
      const int64_t seen = position + 1 - first - low;
      key_t = keys_t.narrow(2, low, seen);
      value = values.narrow(1, low, seen);
    }
    at::Tensor scores = at::baddbmm(model.unused, queries.select(0, i), key_t, 0, layer.scaling);
    rows.push_back(at::bmm(at::softmax(scores, -1), value).view({1, q_width}));
  }
  return n == 1 ? rows[0] : at::cat(rows);
}

// Every decoder layer over the residual stream h [n, hidden] float32, in place (CompactForward.__call__'s loop).
void layers(int64_t handle, at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t start,
            int64_t write_start, int64_t read_start, int64_t kv_len, const std::vector<at::Tensor>& tree) {
  c10::InferenceMode inference;
  std::shared_ptr<Model> model;
  {
    std::lock_guard<std::mutex> guard(models_lock);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(models.size()) && models[handle],
                "specchat_native: no model ", handle);
    model = models[handle];
  }
  const int64_t n = h.size(0);
  for (const Layer& layer : model->layers) {
    const int64_t d = layer.head_dim, q_width = layer.heads * d, kv_width = layer.kv_heads * d;
    // attention
    at::Tensor qkv = layer.qkv(rms_norm(h, layer.norm1, layer.eps1), model->dtype);
    at::Tensor qk = qkv.narrow(1, 0, q_width + kv_width);
    at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
    qk = qk.view({1, n, layer.heads + layer.kv_heads, d}).transpose(1, 2);
    qk = rotary(qk, cos, signed_sin);
    at::Tensor q = qk.narrow(1, 0, layer.heads), k = qk.narrow(1, layer.heads, layer.kv_heads);
    v = v.view({1, n, layer.kv_heads, d}).transpose(1, 2);
    at::Tensor out = attend_rows(*model, layer, q, k, v, start, write_start, read_start, kv_len, tree);
    add_into(h, layer.o(out, model->dtype));
    // MLP
    at::Tensor gate_up = layer.gate_up(rms_norm(h, layer.norm2, layer.eps2), model->dtype);
    at::Tensor gate = gate_up.narrow(1, 0, layer.inter), up = gate_up.narrow(1, layer.inter, layer.inter);
    add_into(h, layer.down(gated(gate, up), model->dtype));
  }
}

}  // namespace

TORCH_LIBRARY(specchat_native, m) {
  m.def("prepare(Tensor?[] tensors, int[] ints, float[] floats, ScalarType dtype) -> int", &prepare);
  m.def("release(int handle) -> ()", &release);
  m.def("layers(int handle, Tensor(a!) h, Tensor cos, Tensor signed_sin, int start, int write_start, "
        "int read_start, int kv_len, Tensor[] tree) -> ()",
        &layers);
}
