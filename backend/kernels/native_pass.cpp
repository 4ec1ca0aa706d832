// The compact forward's decoder layers for passes of up to 64 tokens, in C++: the same ATen operations, in the
// same order, on the same tensors as backend/kernels/compact.py's Python loop (CompactForward._attention,
// _attend_rows on a contiguous run of cache slots, _mlp), so each result is the Python loop's bit for bit.
// Only the Python interpreter and its per-operation argument parsing (~1,300 calls a token) are left out.
// backend/kernels/native.py builds this file with the machine's C++ compiler into a cached library and binds
// a model's tensors to it once (prepare); tests/backend/kernels/test_native.py checks the equality.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace {

struct Projection {  // an Int4Linear: quant_linear.kernel_call's call on a 2-D input of at most 160 rows
  at::Tensor packed, scales_zeros;
  std::optional<at::Tensor> bias;
  int64_t group = 0;

  at::Tensor operator()(const at::Tensor& x, at::ScalarType dtype) const {
    at::Tensor out = at::_weight_int4pack_mm_for_cpu(x.to(dtype).contiguous(), packed, group, scales_zeros);
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
  layer.k_pool.slice(2, write_start, write_start + n).copy_(k);
  layer.v_pool.slice(2, write_start, write_start + n).copy_(v);
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
  const int64_t n = h.size(0), hidden = h.size(1);
  for (const Layer& layer : model->layers) {
    const int64_t d = layer.head_dim, q_width = layer.heads * d, kv_width = layer.kv_heads * d;
    // attention
    at::Tensor qkv = layer.qkv(at::rms_norm(h, {hidden}, layer.norm1, layer.eps1), model->dtype);
    at::Tensor qk = qkv.narrow(1, 0, q_width + kv_width);
    at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
    qk = qk.view({1, n, layer.heads + layer.kv_heads, d}).transpose(1, 2);
    qk = qk * cos + qk.roll({d / 2}, {-1}) * signed_sin;
    at::Tensor q = qk.narrow(1, 0, layer.heads), k = qk.narrow(1, layer.heads, layer.kv_heads);
    v = v.view({1, n, layer.kv_heads, d}).transpose(1, 2);
    at::Tensor out = attend_rows(*model, layer, q, k, v, start, write_start, read_start, kv_len, tree);
    h.add_(layer.o(out, model->dtype));
    // MLP
    at::Tensor gate_up = layer.gate_up(at::rms_norm(h, {hidden}, layer.norm2, layer.eps2), model->dtype);
    at::Tensor gate = gate_up.narrow(1, 0, layer.inter), up = gate_up.narrow(1, layer.inter, layer.inter);
    at::Tensor act = gate.to(at::kFloat);
    h.add_(layer.down(at::silu_(act).mul_(up), model->dtype));
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
