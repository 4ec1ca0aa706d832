// The native model: a whole decoder pass over GGUF blocks (or float weights) in C++, for the architectures of
// transformers' llama, mistral, qwen2, qwen3, gemma2, gemma3 (text) and phi3 families.
//
// torch.classes.specchat.NativeModel is built from Python by name (backend/kernels/native_model.py): settings
// with set("hidden", 576), weights with set_weight / set_layer_weight ("q", a QWeight), vectors with set_tensor /
// set_layer_tensor ("attn_norm", a float32 tensor), rotary tables with add_rope; check() / finish() check that
// every layer is complete and consistent, naming what is missing. forward() runs one pass over the engine's paged
// KV cache (bind_cache) and returns the float32 logits of the last rows, plus the residual stream after the
// layers asked for ("taps"). model_forward.cpp holds the pass, model.cpp the setters and the registration.
//
// Row independence: every operation of a pass computes a row from that row's inputs only, by the same arithmetic
// whatever the number of rows (the kernels' contract, row-wise norms and elementwise loops, and attention_pass.h's
// attention, which shares the reading of keys between rows but not their sums), so a row's logits are bit for bit
// those a one-token pass gives it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "qweight.h"

namespace specchat {

// Names of the weights and vectors a layer may hold (set_layer_weight / set_layer_tensor).
enum class LayerMatrix : int { Q, K, V, QKV, O, Gate, Up, GateUp, Down, Count };
enum class LayerVector : int { AttnNorm, FfnNorm, PostAttnNorm, PostFfnNorm, QNorm, KNorm, QBias, KBias, VBias, Count };

struct Layer {
  std::array<c10::intrusive_ptr<QWeight>, static_cast<size_t>(LayerMatrix::Count)> matrices;
  std::array<at::Tensor, static_cast<size_t>(LayerVector::Count)> vectors;         // as handed in
  std::array<std::vector<float>, static_cast<size_t>(LayerVector::Count)> values;  // finish(): norms with +1 applied
  int64_t window = -1;  // sliding window in keys (-1: full attention)
  int64_t rope = 0;     // index of its rotary table
  const QMatrix* matrix(LayerMatrix m) const {
    const auto& w = matrices[static_cast<size_t>(m)];
    return w ? &w->matrix() : nullptr;
  }
  const float* vector(LayerVector v) const {
    const auto& x = values[static_cast<size_t>(v)];
    return x.empty() ? nullptr : x.data();
  }
};

struct Shape {  // finish() reads these from the settings
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, rot_dim = 0, inter = 0, vocab = 0;
  float eps = 1e-6f, embed_scale = 1.0f, attn_scale = 0.0f, attn_cap = 0.0f, final_cap = 0.0f;
  bool norm_add_one = false, gelu = false;
};

struct Rope {  // cos / sin of positions 0 .. positions-1, rot_dim / 2 angles each
  std::vector<float> cos, sin;
  int64_t positions = 0;
};

struct Profile {  // seconds per part of the pass, while profiling is on
  double kernels = 0, attention = 0, elementwise = 0;
  int64_t passes = 0, rows = 0;
};

// One sequence's rows in a pass (model_batch.cpp builds and checks them): its own block table, positions, and
// chain or tree of drafts; rows of several sequences share a pass's weight kernels, each row still its own.
struct Segment {
  int64_t first = 0, rows = 0;         // the pass's rows [first, first + rows)
  int64_t start = 0;                   // the position of its first row (the sequence's committed length)
  int64_t read_start = -1;             // position p in slot read_start + p, unless map
  at::Tensor slot_map;                 // owns map's values
  const int64_t* map = nullptr;        // position p in slot map[p]
  bool tree = false;                   // parent / depth from a tree of drafts (else a chain: depth = row)
  std::vector<int64_t> parent, depth;  // per row of the segment
  int64_t keep = 1;                    // logits of its last keep rows
  int64_t slot(int64_t position) const { return map ? map[position] : read_start + position; }
};

struct NativeModel : torch::CustomClassHolder {
  void set(const std::string& name, const c10::IValue& value);
  c10::IValue get(const std::string& name) const;
  void set_weight(const std::string& name, const c10::IValue& weight);  // a QWeight
  void set_tensor(const std::string& name, const at::Tensor& value);
  int64_t add_layer();
  void set_layer(int64_t layer, const std::string& name, int64_t value);
  void set_layer_weight(int64_t layer, const std::string& name, const c10::IValue& weight);  // a QWeight
  void set_layer_tensor(int64_t layer, const std::string& name, const at::Tensor& value);
  int64_t add_rope(const at::Tensor& cos, const at::Tensor& sin);
  void bind_cache(const at::Tensor& k, const at::Tensor& v);
  void check();   // the settings and every weight present and of consistent shapes (no cache needed)
  void finish();  // check(), plus the rotary tables and the bound cache
  // ids [n] int64; position p of the sequence is in slot slots[p], or read_start + p when slots is None; parents
  // [n] int64 (-1 for row 0, else an earlier row): a tree of drafts; taps: layer indices (num_layers: after the
  // final norm). Returns (logits [keep, vocab] float32, one [n, hidden] float32 tensor per tap).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& ids, int64_t start, int64_t read_start,
                                                          const std::optional<at::Tensor>& slots,
                                                          const std::optional<at::Tensor>& parents, int64_t keep,
                                                          const std::vector<int64_t>& taps);
  // Several sequences in one pass: ids [N] int64, the rows of segment 0 first; layout [S, 4] int64, per segment
  // (rows, start, read_start or -1, keep); slots / parents: one tensor per segment, empty when read_start is
  // given / for a chain. Returns (logits [sum of keep, vocab] float32, segment by segment; taps [N, hidden]).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward_batch(const at::Tensor& ids, const at::Tensor& layout,
                                                                const std::vector<at::Tensor>& slots,
                                                                const std::vector<at::Tensor>& parents,
                                                                const std::vector<int64_t>& taps);
  c10::Dict<std::string, double> profile() const;
  void reset_profile();

  // -- the pass (model_batch.cpp checks its arguments; model_forward.cpp runs it, with `busy` held) --
  Segment segment(int64_t first, int64_t rows, int64_t start, int64_t read_start,
                  const std::optional<at::Tensor>& slots, const std::optional<at::Tensor>& parents, int64_t keep) const;
  std::tuple<at::Tensor, std::vector<at::Tensor>> run(const at::Tensor& tokens, const std::vector<Segment>& segments,
                                                      const std::vector<int64_t>& taps);

  // -- state (model.cpp fills it; model_forward.cpp runs it) --
  std::map<std::string, c10::IValue> settings;
  c10::intrusive_ptr<QWeight> embed, head;
  at::Tensor final_norm_in;
  std::vector<float> final_norm;
  std::vector<Layer> layers;
  std::vector<Rope> ropes;
  at::Tensor k_pool, v_pool;  // [layers, kv_heads, slots, head_dim], bfloat16 or float32
  Shape shape;
  bool finished = false, profiling = false;
  Profile spent;
  std::mutex busy;  // one pass at a time: the workspace below is shared
  std::vector<float> h, x, qkv, attn, o, gate_up, act, down, normed, kept, scores;
};

}  // namespace specchat
