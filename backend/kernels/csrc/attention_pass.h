// Attention of every row of one pass, for one layer (attention_pass.cpp): the rows share the reading of the keys
// and values they have in common, and each row's arithmetic stays its own.
//
// Per row and query head (the vector version; attention.h's row_scalar runs without AVX2, FMA, F16C):
//   score_j = (q · k_j) · scale: 8 lanes, lane l the fused multiply-adds q[8c + l] · k_j[8c + l] in order of c,
//     then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); with a soft cap c (gemma2), tanh(score_j / c) · c.
//   e_j = exp(score_j − max score) (attention.h's exp8), total = Σ_j e_j in 8 lanes by j mod 8, then lanes_sum.
//   out = (Σ_j e_j · v_j) / total, each output element summed in key order j by fused multiply-adds.
// Every step is a function of the row's query and its own keys and values in their order: not of the other rows
// of the pass, of where its keys sit in the cache, of how the rows are grouped or of the thread split (the
// threads divide keys for the scores, rows for the softmax, and whole output elements for the sums; in a small
// pass, whole KV heads). So a row's result is bit for bit the one-token pass's, in a chain or a tree
// (tests/backend/kernels/test_native_model.py, test_attention_rows.py).
#pragma once

#include <cstdint>
#include <vector>

#include "attention.h"

namespace specchat_attention {

// The rows of one pass: row i's query head h (of kv_heads · rep, the rep heads of KV head g being g·rep ..) at
// q + i · q_stride + h · d, its output at out + i · out_stride + h · d, its keys rows[i]. `work` is scratch the
// caller keeps between calls (grown as needed). With `vector` false, row_scalar runs row by row.
template <class T>
void attend_rows(bool vector, const Pools<T>& pools, const RowKeys* rows, int64_t n, int64_t kv_heads, int64_t rep,
                 Scoring scoring, const float* q, int64_t q_stride, float* out, int64_t out_stride,
                 std::vector<float>& work);

extern template void attend_rows<Half>(bool, const Pools<Half>&, const RowKeys*, int64_t, int64_t, int64_t, Scoring,
                                       const float*, int64_t, float*, int64_t, std::vector<float>&);
extern template void attend_rows<uint16_t>(bool, const Pools<uint16_t>&, const RowKeys*, int64_t, int64_t, int64_t,
                                           Scoring, const float*, int64_t, float*, int64_t, std::vector<float>&);
extern template void attend_rows<float>(bool, const Pools<float>&, const RowKeys*, int64_t, int64_t, int64_t, Scoring,
                                        const float*, int64_t, float*, int64_t, std::vector<float>&);

}  // namespace specchat_attention
