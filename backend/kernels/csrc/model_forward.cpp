// One pass of the native model (model.h): embedding rows, the decoder layers over the paged KV cache, the final
// norm and the head, in float32 between the weight kernels (qgemm.h). Every step computes each row from that row
// alone, by the same code whatever the number of rows, so a pass's rows equal one-token passes bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "attention_pass.h"
#include "model.h"

namespace specchat {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the time from its construction to its destruction to *into, when profiling is on (else costs nothing).
class Timer {
 public:
  Timer(bool on, double* into) : into_(on ? into : nullptr), start_(on ? Clock::now() : Clock::time_point()) {}
  ~Timer() {
    if (into_) *into_ += std::chrono::duration<double>(Clock::now() - start_).count();
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

 private:
  double* into_;
  Clock::time_point start_;
};

// out = x · (1 / √(mean(x²) + eps)) · w over n values (transformers' RMSNorm in float32; the mean's sum in 8
// partial sums, then those in a fixed order). out may be x.
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int l = 0; l < 8; ++l) part[l] += x[j + l] * x[j + l];
  }
  for (int l = 0; j < n; ++j, ++l) part[l] += x[j] * x[j];
  const float squares = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (j = 0; j < n; ++j) out[j] = (x[j] * scale) * w[j];
}

// Rotary embedding of one head's first 2·half values (transformers' rotate_half layout): x·cos + rotate_half(x)·sin.
void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

float gelu_tanh(float x) {  // PyTorch's gelu(approximate="tanh")
  constexpr float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  const float inner = beta * (x + kappa * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

template <class T>
T to_pool(float x);
template <>
c10::BFloat16 to_pool(float x) {
  return c10::BFloat16(x);  // round to nearest even, as ATen converts
}
template <>
specchat_attention::Half to_pool(float x) {
  // round to nearest even, as llama.cpp's f16 cache stores K and V; beyond float16's range, its largest value
  // rather than an infinity (whose attention would be NaN)
  return specchat_attention::Half{c10::Half(std::isnan(x) ? x : std::min(65504.0f, std::max(-65504.0f, x))).x};
}
template <>
float to_pool(float x) {
  return x;
}

// Rows [0, n) in chunks over the compute threads (each row's arithmetic is its own).
template <class F>
void each_row(int64_t n, F&& body) {
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(i);
  });
}

// The keys each row of a tree pass attends, by position: its window of the committed prefix, then its ancestors
// and itself among the new rows (position start + row), in row order, which is their order along its path.
std::vector<std::vector<int64_t>> tree_keys(const std::vector<int64_t>& parent, const std::vector<int64_t>& depth,
                                            int64_t start, int64_t window) {
  const int64_t n = static_cast<int64_t>(parent.size());
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = depth[static_cast<size_t>(i)];
    const int64_t low = window > 0 ? std::max<int64_t>(0, start + d - window + 1) : 0;
    std::vector<int64_t>& keys = out[static_cast<size_t>(i)];
    for (int64_t p = low; p < start; ++p) keys.push_back(p);
    std::vector<int64_t> path;
    for (int64_t j = i; j >= 0; j = parent[static_cast<size_t>(j)]) {
      if (window <= 0 || depth[static_cast<size_t>(j)] > d - window) path.push_back(start + j);
    }
    keys.insert(keys.end(), path.rbegin(), path.rend());
  }
  return out;
}

}  // namespace

std::tuple<at::Tensor, std::vector<at::Tensor>> NativeModel::run(const at::Tensor& tokens,
                                                                 const std::vector<Segment>& segments,
                                                                 const std::vector<int64_t>& taps) {
  const Shape& s = shape;
  const int64_t n = tokens.numel(), layer_count = static_cast<int64_t>(layers.size());
  for (int64_t t : taps) {
    TORCH_CHECK(t >= 0 && t <= layer_count, "NativeModel.forward: tap ", t, " (layers 0..", layer_count - 1, ", or ",
                layer_count, " for the final norm's output)");
  }
  const int64_t pool_slots = k_pool.size(2);
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < s.vocab, "NativeModel.forward: token id ", tok[i], " (vocabulary ", s.vocab,
                ")");
  }
  // Each row's position and the slot its K/V go to; the rows whose logits are kept, segment by segment.
  std::vector<int64_t> position(static_cast<size_t>(n)), write_slot(static_cast<size_t>(n)), kept_rows;
  for (const Segment& g : segments) {
    for (int64_t i = 0; i < g.rows; ++i) {
      position[static_cast<size_t>(g.first + i)] = g.start + g.depth[static_cast<size_t>(i)];
      write_slot[static_cast<size_t>(g.first + i)] = g.slot(g.start + i);
    }
    for (int64_t i = g.rows - g.keep; i < g.rows; ++i) kept_rows.push_back(g.first + i);
  }
  const int64_t keep = static_cast<int64_t>(kept_rows.size());
  const int64_t hidden = s.hidden, d = s.head_dim, q_width = s.heads * d, kv_width = s.kv_heads * d;
  const int64_t qkv_width = q_width + 2 * kv_width, inter = s.inter, rep = s.heads / s.kv_heads, half = s.rot_dim / 2;
  auto grow = [](std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
    return v.data();
  };
  float* hp = grow(h, n * hidden);
  float* xp = grow(x, n * hidden);
  float* qkvp = grow(qkv, n * qkv_width);
  float* attnp = grow(attn, n * q_width);
  float* op = grow(o, n * hidden);
  float* gup = grow(gate_up, n * 2 * inter);
  float* actp = grow(act, n * inter);
  float* downp = grow(down, n * hidden);
  const bool on = profiling;
  if (on) {
    spent.passes += 1;
    spent.rows += n;
  }
  {
    Timer t(on, &spent.kernels);
    for (int64_t i = 0; i < n; ++i) embed->matrix().dequantize_row(tok[i], hp + i * hidden);
  }
  if (s.embed_scale != 1.0f) {
    Timer t(on, &spent.elementwise);
    for (int64_t j = 0; j < n * hidden; ++j) hp[j] = hp[j] * s.embed_scale;
  }
  std::vector<at::Tensor> tapped(taps.size());
  auto tap = [&](int64_t after) {
    for (size_t t = 0; t < taps.size(); ++t) {
      if (taps[t] == after) tapped[t] = at::from_blob(hp, {n, hidden}, at::kFloat).clone();
    }
  };
  const at::ScalarType pool_type = k_pool.scalar_type();
  const bool vector = specchat_attention::vector_ok(d);
  // (segment, window) -> each row's key positions
  std::map<std::pair<size_t, int64_t>, std::vector<std::vector<int64_t>>> tree_cache;
  for (int64_t li = 0; li < layer_count; ++li) {
    const Layer& l = layers[static_cast<size_t>(li)];
    const Rope& rope = ropes[static_cast<size_t>(l.rope)];
    {
      Timer t(on, &spent.elementwise);
      each_row(n, [&](int64_t i) {
        rms_norm(hp + i * hidden, l.vector(LayerVector::AttnNorm), xp + i * hidden, hidden, s.eps);
      });
    }
    {
      Timer t(on, &spent.kernels);
      if (const QMatrix* fused = l.matrix(LayerMatrix::QKV)) {
        matmul(*fused, xp, n, qkvp, qkv_width);
      } else {
        matmul_many({l.matrix(LayerMatrix::Q), l.matrix(LayerMatrix::K), l.matrix(LayerMatrix::V)}, xp, n,
                    {qkvp, qkvp + q_width, qkvp + q_width + kv_width}, {qkv_width, qkv_width, qkv_width});
      }
    }
    {
      Timer t(on, &spent.elementwise);
      const float* qb = l.vector(LayerVector::QBias);
      const float* kb = l.vector(LayerVector::KBias);
      const float* vb = l.vector(LayerVector::VBias);
      const float* qn = l.vector(LayerVector::QNorm);
      const float* kn = l.vector(LayerVector::KNorm);
      each_row(n, [&](int64_t i) {
        float* row = qkvp + i * qkv_width;
        if (qb)
          for (int64_t j = 0; j < q_width; ++j) row[j] = row[j] + qb[j];
        if (kb)
          for (int64_t j = 0; j < kv_width; ++j) row[q_width + j] = row[q_width + j] + kb[j];
        if (vb)
          for (int64_t j = 0; j < kv_width; ++j) row[q_width + kv_width + j] = row[q_width + kv_width + j] + vb[j];
        const float* cos = rope.cos.data() + position[static_cast<size_t>(i)] * half;
        const float* sin = rope.sin.data() + position[static_cast<size_t>(i)] * half;
        for (int64_t hd = 0; hd < s.heads + s.kv_heads; ++hd) {
          float* head = row + hd * d;
          const float* norm = hd < s.heads ? qn : kn;
          if (norm) rms_norm(head, norm, head, d, s.eps);
          rotate(head, cos, sin, half);
        }
      });
    }
    {
      Timer t(on, &spent.attention);
      // The new rows' K and V into their slots (position start + i), then each row over the keys it sees.
      const int64_t layer_offset = li * s.kv_heads * pool_slots * d;
      auto write = [&](auto* kp, auto* vp) {
        using T = std::remove_pointer_t<decltype(kp)>;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t slot = write_slot[static_cast<size_t>(i)];
          const float* row = qkvp + i * qkv_width;
          for (int64_t g = 0; g < s.kv_heads; ++g) {
            T* kd = kp + layer_offset + (g * pool_slots + slot) * d;
            T* vd = vp + layer_offset + (g * pool_slots + slot) * d;
            for (int64_t j = 0; j < d; ++j) {
              kd[j] = to_pool<T>(row[q_width + g * d + j]);
              vd[j] = to_pool<T>(row[q_width + kv_width + g * d + j]);
            }
          }
        }
      };
      // Each row's keys (attention.h's RowKeys), within its segment: its window of the committed prefix, then its
      // own among the new rows (a chain: every row up to itself; a tree: its ancestors and itself).
      std::vector<specchat_attention::RowKeys> seen(static_cast<size_t>(n));
      for (size_t gi = 0; gi < segments.size(); ++gi) {
        const Segment& g = segments[gi];
        const int64_t start = g.start;
        specchat_attention::RowKeys* rk = seen.data() + g.first;
        if (g.tree) {
          auto found = tree_cache.find({gi, l.window});
          if (found == tree_cache.end())
            found =
                tree_cache.emplace(std::make_pair(gi, l.window), tree_keys(g.parent, g.depth, start, l.window)).first;
          for (int64_t i = 0; i < g.rows; ++i) {
            const std::vector<int64_t>& keys = found->second[static_cast<size_t>(i)];
            auto& r = rk[i];
            r.committed = std::lower_bound(keys.begin(), keys.end(), start) - keys.begin();
            r.low = r.committed > 0 ? keys[0] : 0;
            r.index = keys.data() + r.committed;
            r.extra = static_cast<int64_t>(keys.size()) - r.committed;
          }
        } else {
          for (int64_t i = 0; i < g.rows; ++i) {
            const int64_t low = l.window > 0 ? std::max<int64_t>(0, start + i - l.window + 1) : 0;
            auto& r = rk[i];
            r.low = std::min(low, start);
            r.committed = start - r.low;
            r.fresh = std::max(low, start);
            r.extra = start + i + 1 - r.fresh;
          }
        }
      }
      const specchat_attention::Scoring scoring{s.attn_scale, s.attn_cap};
      auto attend = [&](const auto* kp, const auto* vp) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
        for (const Segment& g : segments) {  // each sequence over its own slots
          specchat_attention::Pools<T> pools;
          pools.k = kp + layer_offset;
          pools.v = vp + layer_offset;
          pools.slots = pool_slots;
          pools.d = d;
          pools.map = g.map;
          pools.read_start = g.read_start;
          specchat_attention::attend_rows(vector, pools, seen.data() + g.first, g.rows, s.kv_heads, rep, scoring,
                                          qkvp + g.first * qkv_width, qkv_width, attnp + g.first * q_width, q_width,
                                          scores);
        }
      };
      if (pool_type == at::kHalf) {
        auto* kp = reinterpret_cast<specchat_attention::Half*>(k_pool.mutable_data_ptr<c10::Half>());
        auto* vp = reinterpret_cast<specchat_attention::Half*>(v_pool.mutable_data_ptr<c10::Half>());
        write(kp, vp);
        attend(static_cast<const specchat_attention::Half*>(kp), static_cast<const specchat_attention::Half*>(vp));
      } else if (pool_type == at::kBFloat16) {
        auto* kp = reinterpret_cast<uint16_t*>(k_pool.mutable_data_ptr<c10::BFloat16>());
        auto* vp = reinterpret_cast<uint16_t*>(v_pool.mutable_data_ptr<c10::BFloat16>());
        write(reinterpret_cast<c10::BFloat16*>(kp), reinterpret_cast<c10::BFloat16*>(vp));
        attend(static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp));
      } else {
        float* kp = k_pool.mutable_data_ptr<float>();
        float* vp = v_pool.mutable_data_ptr<float>();
        write(kp, vp);
        attend(static_cast<const float*>(kp), static_cast<const float*>(vp));
      }
    }
    {
      Timer t(on, &spent.kernels);
      matmul(*l.matrix(LayerMatrix::O), attnp, n, op, hidden);
    }
    {
      Timer t(on, &spent.elementwise);
      const float* post = l.vector(LayerVector::PostAttnNorm);
      each_row(n, [&](int64_t i) {
        float* out = op + i * hidden;
        if (post) rms_norm(out, post, out, hidden, s.eps);
        float* res = hp + i * hidden;
        for (int64_t j = 0; j < hidden; ++j) res[j] = res[j] + out[j];
        rms_norm(res, l.vector(LayerVector::FfnNorm), xp + i * hidden, hidden, s.eps);
      });
    }
    {
      Timer t(on, &spent.kernels);
      if (const QMatrix* fused = l.matrix(LayerMatrix::GateUp)) {
        matmul(*fused, xp, n, gup, 2 * inter);
      } else {
        matmul_many({l.matrix(LayerMatrix::Gate), l.matrix(LayerMatrix::Up)}, xp, n, {gup, gup + inter},
                    {2 * inter, 2 * inter});
      }
    }
    {
      Timer t(on, &spent.elementwise);
      each_row(n, [&](int64_t i) {
        const float* gate = gup + i * 2 * inter;
        const float* up = gate + inter;
        float* a = actp + i * inter;
        if (s.gelu) {
          for (int64_t j = 0; j < inter; ++j) a[j] = gelu_tanh(gate[j]) * up[j];
        } else {
          for (int64_t j = 0; j < inter; ++j) a[j] = silu(gate[j]) * up[j];
        }
      });
    }
    {
      Timer t(on, &spent.kernels);
      matmul(*l.matrix(LayerMatrix::Down), actp, n, downp, hidden);
    }
    {
      Timer t(on, &spent.elementwise);
      const float* post = l.vector(LayerVector::PostFfnNorm);
      each_row(n, [&](int64_t i) {
        float* out = downp + i * hidden;
        if (post) rms_norm(out, post, out, hidden, s.eps);
        float* res = hp + i * hidden;
        for (int64_t j = 0; j < hidden; ++j) res[j] = res[j] + out[j];
      });
    }
    tap(li);
  }
  // The final norm over the rows whose logits are kept (every row when the final norm's output is tapped), then
  // the head over the kept rows, gathered in segment order.
  const bool tap_final = std::find(taps.begin(), taps.end(), layer_count) != taps.end();
  const int64_t normed_rows = tap_final ? n : keep;
  float* np = grow(normed, normed_rows * hidden);
  {
    Timer t(on, &spent.elementwise);
    each_row(normed_rows, [&](int64_t i) {
      const int64_t row = tap_final ? i : kept_rows[static_cast<size_t>(i)];
      rms_norm(hp + row * hidden, final_norm.data(), np + i * hidden, hidden, s.eps);
    });
  }
  const float* head_in = np;
  if (tap_final) {
    for (size_t t = 0; t < taps.size(); ++t) {
      if (taps[t] == layer_count) tapped[t] = at::from_blob(np, {n, hidden}, at::kFloat).clone();
    }
    float* kp = grow(kept, keep * hidden);
    for (int64_t i = 0; i < keep; ++i) {
      std::copy_n(np + kept_rows[static_cast<size_t>(i)] * hidden, hidden, kp + i * hidden);
    }
    head_in = kp;
  }
  at::Tensor logits = at::empty({keep, s.vocab}, at::kFloat);
  float* lp = logits.mutable_data_ptr<float>();
  {
    Timer t(on, &spent.kernels);
    matmul(head ? head->matrix() : embed->matrix(), head_in, keep, lp, s.vocab);
  }
  if (s.final_cap > 0.0f) {
    Timer t(on, &spent.elementwise);
    for (int64_t j = 0; j < keep * s.vocab; ++j) lp[j] = std::tanh(lp[j] / s.final_cap) * s.final_cap;
  }
  return {logits, tapped};
}

}  // namespace specchat
