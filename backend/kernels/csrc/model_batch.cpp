// A pass's arguments (model.h): one sequence's (forward) or several sequences' (forward_batch), checked and turned
// into Segments for model_forward.cpp's run. A segment is exactly what forward of that sequence alone would run,
// so its rows' results do not depend on the segments beside it.
#include <ATen/ATen.h>

#include <algorithm>

#include "model.h"

namespace specchat {

Segment NativeModel::segment(int64_t first, int64_t rows, int64_t start, int64_t read_start,
                             const std::optional<at::Tensor>& slots, const std::optional<at::Tensor>& parents,
                             int64_t keep) const {
  Segment g;
  g.first = first;
  g.rows = rows;
  g.start = start;
  g.keep = keep;
  const int64_t kv_len = start + rows;
  TORCH_CHECK(rows >= 1 && start >= 0 && keep >= 1 && keep <= rows, "NativeModel.forward: ", rows, " tokens after ",
              start, ", keeping ", keep);
  const int64_t pool_slots = k_pool.size(2);
  if (slots) {
    g.slot_map = slots->to(at::kLong).contiguous();
    TORCH_CHECK(g.slot_map.numel() >= kv_len, "NativeModel.forward: ", g.slot_map.numel(), " slots for ", kv_len,
                " keys");
    g.map = g.slot_map.const_data_ptr<int64_t>();
    for (int64_t p = 0; p < kv_len; ++p) {
      TORCH_CHECK(g.map[p] >= 0 && g.map[p] < pool_slots, "NativeModel.forward: slot ", g.map[p], " outside the cache");
    }
  } else {
    TORCH_CHECK(read_start >= 0 && read_start + kv_len <= pool_slots, "NativeModel.forward: slots ", read_start, "..",
                read_start + kv_len, " outside the cache's ", pool_slots);
    g.read_start = read_start;
  }
  // Rows' positions (start + depth in a tree) and, for a tree, each row's parent.
  g.parent.assign(static_cast<size_t>(rows), -1);
  g.depth.resize(static_cast<size_t>(rows));
  g.tree = parents.has_value();
  if (g.tree) {
    const at::Tensor p = parents->to(at::kLong).contiguous();
    TORCH_CHECK(p.numel() == rows, "NativeModel.forward: ", p.numel(), " parents for ", rows, " rows");
    const int64_t* pp = p.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK((i == 0 && pp[i] == -1) || (i > 0 && pp[i] >= 0 && pp[i] < i), "NativeModel.forward: row ", i,
                  "'s parent ", pp[i], " (row 0: -1; others an earlier row)");
      g.parent[static_cast<size_t>(i)] = pp[i];
      g.depth[static_cast<size_t>(i)] = i == 0 ? 0 : g.depth[static_cast<size_t>(pp[i])] + 1;
    }
  } else {
    for (int64_t i = 0; i < rows; ++i) g.depth[static_cast<size_t>(i)] = i;
  }
  for (const Layer& l : layers) {
    const Rope& rope = ropes[static_cast<size_t>(l.rope)];
    TORCH_CHECK(start + g.depth.back() < rope.positions && kv_len <= rope.positions, "NativeModel.forward: position ",
                kv_len - 1, " is beyond the rotary table's ", rope.positions, " positions");
  }
  return g;
}

std::tuple<at::Tensor, std::vector<at::Tensor>> NativeModel::forward(const at::Tensor& ids, int64_t start,
                                                                     int64_t read_start,
                                                                     const std::optional<at::Tensor>& slots,
                                                                     const std::optional<at::Tensor>& parents,
                                                                     int64_t keep, const std::vector<int64_t>& taps) {
  std::lock_guard<std::mutex> guard(busy);
  if (!finished) finish();
  const at::Tensor tokens = ids.to(at::kLong).contiguous().view({-1});
  return run(tokens, {segment(0, tokens.numel(), start, read_start, slots, parents, keep)}, taps);
}

std::tuple<at::Tensor, std::vector<at::Tensor>> NativeModel::forward_batch(const at::Tensor& ids,
                                                                           const at::Tensor& layout,
                                                                           const std::vector<at::Tensor>& slots,
                                                                           const std::vector<at::Tensor>& parents,
                                                                           const std::vector<int64_t>& taps) {
  std::lock_guard<std::mutex> guard(busy);
  if (!finished) finish();
  const at::Tensor tokens = ids.to(at::kLong).contiguous().view({-1});
  const at::Tensor table = layout.to(at::kLong).contiguous();
  const int64_t count = table.dim() == 2 && table.size(1) == 4 ? table.size(0) : -1;
  TORCH_CHECK(count >= 1, "NativeModel.forward_batch: layout must be [segments, 4] (rows, start, read_start, keep)");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == count && static_cast<int64_t>(parents.size()) == count,
              "NativeModel.forward_batch: ", count, " segments need as many slot and parent tensors, got ",
              slots.size(), " and ", parents.size());
  const int64_t* t = table.const_data_ptr<int64_t>();
  std::vector<Segment> segments;
  segments.reserve(static_cast<size_t>(count));
  int64_t first = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t* row = t + s * 4;
    const auto& map = slots[static_cast<size_t>(s)];
    const auto& tree = parents[static_cast<size_t>(s)];
    std::optional<at::Tensor> map_of = row[2] < 0 ? std::optional<at::Tensor>(map) : std::nullopt;
    std::optional<at::Tensor> tree_of = tree.numel() > 0 ? std::optional<at::Tensor>(tree) : std::nullopt;
    segments.push_back(segment(first, row[0], row[1], row[2], map_of, tree_of, row[3]));
    first += row[0];
  }
  TORCH_CHECK(first == tokens.numel(), "NativeModel.forward_batch: the segments hold ", first, " rows, ids ",
              tokens.numel());
  return run(tokens, segments, taps);
}

}  // namespace specchat
