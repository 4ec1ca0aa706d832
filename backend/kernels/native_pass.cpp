// The compact forward's decoder layers for passes of up to 64 tokens, in C++: backend/kernels/compact.py's
// Python loop (CompactForward._attention, _attend_rows, _mlp) in one call per pass. The int4 kernels,
// reductions and SiLU are the same ATen calls; the elementwise chains between them are exact loops (below), so
// those steps give the Python loop's results bit for bit. Attention is native_attention.h's: each query row over
// exactly the keys it sees, read from the paged cache through its slot map, in an order of its own, so a pass's
// rows equal one-token passes bit for bit while the logits match the Python loop's to rounding only. Left out:
// the Python interpreter and its per-operation argument parsing (~1,300 calls a token), most of the chains'
// dispatch and temporaries, and the float32 copies of the keys and values the row-wise attention read.
// backend/kernels/native.py builds this file with the machine's C++ compiler into a cached library, binds a
// model's tensors to it once (prepare) and checks it; tests/backend/kernels/test_native.py tests it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "native_attention.h"

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
  bool vector = false;                    // native_attention.h's AVX2 version (else its scalar one)
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

// One head's K or V row into the pool's element type (bfloat16 rounds to nearest even, as ATen converts).
template <class Out, class In>
void copy_row(Out* y, const In* x, int64_t d) {
  for (int64_t j = 0; j < d; ++j) y[j] = static_cast<Out>(x[j]);
}

// The new tokens' K or V x [1, kv_heads, n, head_dim] (float32 or bfloat16, unit stride over head_dim) into
// their slots of a contiguous cache pool [1, kv_heads, slots, head_dim] of bfloat16 or float32: position
// start + t goes to slot map[start + t], or read_start + start + t without a map (PagedKVCache.write).
template <class Out, class In>
void write_slots_as(const at::Tensor& pool, const at::Tensor& x, int64_t start, int64_t read_start,
                    const int64_t* map) {
  const int64_t heads = x.size(1), n = x.size(2), d = x.size(3), slots = pool.size(2);
  Out* out = pool.mutable_data_ptr<Out>();
  const In* in = x.const_data_ptr<In>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = map ? map[start + t] : read_start + start + t;
      copy_row(out + (h * slots + slot) * d, in + h * x.stride(1) + t * x.stride(2), d);
    }
  }
}

void write_slots(const at::Tensor& pool, const at::Tensor& x, int64_t start, int64_t read_start, const int64_t* map) {
  const bool bf16_pool = pool.scalar_type() == at::kBFloat16, bf16_x = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(pool.is_contiguous() && x.stride(3) == 1 && (bf16_pool || pool.scalar_type() == at::kFloat) &&
                  (bf16_x || x.scalar_type() == at::kFloat),
              "specchat_native: K/V of ", x.scalar_type(), " into a ", pool.scalar_type(), " pool");
  if (bf16_pool) {
    bf16_x ? write_slots_as<c10::BFloat16, c10::BFloat16>(pool, x, start, read_start, map)
           : write_slots_as<c10::BFloat16, float>(pool, x, start, read_start, map);
  } else {
    bf16_x ? write_slots_as<float, c10::BFloat16>(pool, x, start, read_start, map)
           : write_slots_as<float, float>(pool, x, start, read_start, map);
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
                const std::vector<double>& floats, at::ScalarType dtype, bool scalar) {
  const int64_t count = static_cast<int64_t>(ints.size()) / kInts;
  TORCH_CHECK(count * kInts == static_cast<int64_t>(ints.size()) &&
                  count * kTensors == static_cast<int64_t>(tensors.size()) &&
                  count * kFloats == static_cast<int64_t>(floats.size()),
              "specchat_native.prepare: ", tensors.size(), " tensors, ", ints.size(), " ints and ", floats.size(),
              " floats are not whole layers");
  auto model = std::make_shared<Model>();
  model->dtype = dtype;
  model->vector = true;
  for (int64_t l = 0; l < count; ++l) {
    const int64_t heads = ints[l * kInts + 4], kv_heads = ints[l * kInts + 5], d = ints[l * kInts + 6];
    model->vector = model->vector && !scalar && specchat_attention::vector_ok(heads / kv_heads, d);
  }
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

// Attention over the paged cache: write the new K/V, then each query row over exactly the keys it sees
// (native_attention.h), one row and KV head at a time. ``map``: the slot of each position 0 .. kv_len-1, or
// nullptr when position p is in slot read_start + p. ``tree`` (a tree of drafts, no sliding window in effect):
// per new token, the positions of the keys it attends. Returns [n, heads * head_dim] float32.
at::Tensor attend_rows(const Model& model, const Layer& layer, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, int64_t start, int64_t read_start, int64_t kv_len, const int64_t* map,
                       const std::vector<at::Tensor>& tree) {
  const int64_t n = q.size(2), d = layer.head_dim, q_width = layer.heads * d, rep = layer.heads / layer.kv_heads;
  write_slots(layer.k_pool, k, start, read_start, map);
  write_slots(layer.v_pool, v, start, read_start, map);
  TORCH_CHECK(layer.k_pool.is_contiguous() && layer.v_pool.is_contiguous() &&
                  layer.k_pool.scalar_type() == layer.v_pool.scalar_type(),
              "specchat_native: the cache pools must be contiguous and of one dtype");
  const bool windowed = layer.window >= 0 && layer.window < kv_len;
  const int64_t first = windowed ? std::max<int64_t>(0, start - layer.window + 1) : 0;
  const at::Tensor queries = q.to(at::kFloat).select(0, 0).transpose(0, 1).contiguous();  // [n, heads, d]
  const float* qp = queries.const_data_ptr<float>();
  at::Tensor out = at::empty({n, q_width}, at::kFloat);
  float* op = out.mutable_data_ptr<float>();
  std::vector<at::Tensor> indices;
  for (const at::Tensor& t : tree) indices.push_back(t.to(at::kLong).contiguous());
  auto run = [&](auto pools) {
    // Rows and KV heads are independent: the compute threads share them out (each item the same arithmetic).
    at::parallel_for(0, n * layer.kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(rep * (kv_len - first + 8));
      auto keys = pools;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t i = item / layer.kv_heads, head = item % layer.kv_heads, h = head * rep;
        if (!indices.empty()) {  // the committed keys, then the node's ancestors and itself, by slot
          keys.index = indices[i].const_data_ptr<int64_t>();
          keys.count = indices[i].numel();
        } else {
          const int64_t position = start + i;
          keys.low = windowed ? std::max<int64_t>(0, position - layer.window + 1) : 0;
          keys.count = position + 1 - keys.low;
        }
        specchat_attention::row(model.vector, qp + (i * layer.heads + h) * d, rep, keys, head,
                                static_cast<float>(layer.scaling), scratch.data(), op + i * q_width + h * d, d);
      }
    });
  };
  // The pools as native_attention.h reads them: bfloat16 as its raw bits, or float32.
  auto pools_of = [&](auto* k, auto* v) {
    specchat_attention::Keys<std::remove_const_t<std::remove_pointer_t<decltype(k)>>> pools;
    pools.k = k;
    pools.v = v;
    pools.slots = layer.k_pool.size(2);
    pools.d = d;
    pools.map = map;
    pools.read_start = read_start;
    return pools;
  };
  if (layer.k_pool.scalar_type() == at::kBFloat16) {
    run(pools_of(reinterpret_cast<const uint16_t*>(layer.k_pool.const_data_ptr<c10::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(layer.v_pool.const_data_ptr<c10::BFloat16>())));
  } else {
    TORCH_CHECK(layer.k_pool.scalar_type() == at::kFloat, "specchat_native: cache pools of ",
                layer.k_pool.scalar_type(), " (bfloat16 or float32 only)");
    run(pools_of(layer.k_pool.const_data_ptr<float>(), layer.v_pool.const_data_ptr<float>()));
  }
  return out;
}

// Every decoder layer over the residual stream h [n, hidden] float32, in place (CompactForward.__call__'s loop).
void layers(int64_t handle, at::Tensor h, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t start,
            int64_t read_start, int64_t kv_len, const std::optional<at::Tensor>& slots,
            const std::vector<at::Tensor>& tree) {
  c10::InferenceMode inference;
  std::shared_ptr<Model> model;
  {
    std::lock_guard<std::mutex> guard(models_lock);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(models.size()) && models[handle],
                "specchat_native: no model ", handle);
    model = models[handle];
  }
  const int64_t n = h.size(0);
  at::Tensor slot_map;  // the slot of each position, when the sequence's blocks are not one run
  if (slots) {
    slot_map = slots->to(at::kLong).contiguous();
    TORCH_CHECK(slot_map.numel() == kv_len, "specchat_native: ", slot_map.numel(), " slots for ", kv_len, " keys");
  }
  const int64_t* map = slots ? slot_map.const_data_ptr<int64_t>() : nullptr;
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
    at::Tensor out = attend_rows(*model, layer, q, k, v, start, read_start, kv_len, map, tree);
    add_into(h, layer.o(out, model->dtype));
    // MLP
    at::Tensor gate_up = layer.gate_up(rms_norm(h, layer.norm2, layer.eps2), model->dtype);
    at::Tensor gate = gate_up.narrow(1, 0, layer.inter), up = gate_up.narrow(1, layer.inter, layer.inter);
    add_into(h, layer.down(gated(gate, up), model->dtype));
  }
}

}  // namespace

TORCH_LIBRARY(specchat_native, m) {
  m.def("prepare(Tensor?[] tensors, int[] ints, float[] floats, ScalarType dtype, bool scalar) -> int", &prepare);
  m.def("release(int handle) -> ()", &release);
  m.def("layers(int handle, Tensor(a!) h, Tensor cos, Tensor signed_sin, int start, int read_start, int kv_len, "
        "Tensor? slots, Tensor[] tree) -> ()",
        &layers);
}
