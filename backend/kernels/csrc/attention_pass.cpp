// attention_pass.h's pass. The rows go through in groups (as many as their scores fit in kBudget); for each group,
// in one parallel region, three steps with a barrier between them:
//   1. scores: blocks of keys (8 at a time, widened to float32 once) against every query head of every row of the
//      group that sees any of them, into the group's score rows (by position);
//   2. softmax: each (row, query head) gathers its own keys' scores in its key order, then exp and total;
//   3. weighted sums: blocks of kSumKeys values, widened once per block, added into every row's output (kept in
//      `out` itself between blocks), then divided by the totals.
// So each key and value of the keys the rows share is read once per pass, not once per row.
// A group with little work (a short context, few rows) skips the barriers: each thread takes whole KV heads.
#include "attention_pass.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace specchat_attention {
namespace {

constexpr int64_t kTile = 8;                   // keys scored together
constexpr int64_t kScoreTiles = 8;             // tiles per scoring work item
constexpr int64_t kSumKeys = 64;               // values per block of the weighted sums
constexpr int64_t kSumWidth = 32;              // output elements per weighted-sum work item (64 bfloat16 bytes)
constexpr int64_t kSumRows = 8;                // rows per weighted-sum work item
constexpr int64_t kBudget = int64_t{1} << 21;  // floats of scores a group of rows may hold (8 MiB, kept between passes)
constexpr int64_t kHeadSplitWork = 2048;       // (row, head, key) scores below which threads split KV heads
// How far ahead the loops ask for keys and values: at long contexts the pools come from memory, not the caches
// (a row's first load of a key or value otherwise stalls the loop for the memory's latency).
constexpr int64_t kAheadKeys = 16, kAheadValues = 32;

int64_t first_position(const RowKeys& r) { return r.position(0); }
int64_t last_position(const RowKeys& r) { return r.position(r.count() - 1); }

// One group of rows sharing a pass over the keys at positions [first, end).
template <class T>
struct Group {
  const Pools<T>* pools = nullptr;
  const RowKeys* rows = nullptr;  // the group's rows; q and out point at its first row's
  int64_t count = 0, kv_heads = 0, rep = 0, heads = 0;
  Scoring scoring;
  const float* q = nullptr;
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t first = 0, end = 0, stride = 0;  // floats per (row, head) of scores: end - first, rounded up to kTile
  float* scores = nullptr;                 // [count, heads, stride]
  float* totals = nullptr;                 // [count, heads]
  float* row_scores(int64_t i, int64_t h) const { return scores + (i * heads + h) * stride; }
};

#ifdef SPECCHAT_X86
// The scores of 8 keys (kf [8, d] float32) against one query head, before the scale: lane l of the result is key
// l's dot product, 8 lanes of fused multiply-adds then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
SPECCHAT_AVX2 inline __m256 dot8(const float* q, const float* kf, int64_t d) {
  __m256 a[kTile];
  for (int l = 0; l < kTile; ++l) a[l] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int l = 0; l < kTile; ++l) a[l] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kf + l * d + c), a[l]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <class T>
SPECCHAT_AVX2 void score_block(const Group<T>& g, int64_t head, int64_t block) {
  const int64_t d = g.pools->d, tiles = (g.end - g.first + kTile - 1) / kTile;
  thread_local std::vector<float> store;
  if (static_cast<int64_t>(store.size()) < kTile * d) store.resize(static_cast<size_t>(kTile * d));
  float* kf = store.data();
  const __m256 scale = _mm256_set1_ps(g.scoring.scale);
  for (int64_t t = block * kScoreTiles; t < std::min(tiles, (block + 1) * kScoreTiles); ++t) {
    const int64_t p0 = g.first + t * kTile;
    for (int64_t p = p0 + kAheadKeys; p < std::min(g.end, p0 + kAheadKeys + kTile); ++p) {
      const char* ahead = reinterpret_cast<const char*>(g.pools->key(head, p));
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    for (int64_t l = 0; l < kTile; ++l) {  // past the group's last key: zeros, whose scores nobody reads
      float* dst = kf + l * d;
      if (p0 + l >= g.end) {
        std::fill(dst, dst + d, 0.0f);
        continue;
      }
      const T* src = g.pools->key(head, p0 + l);
      for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
    }
    for (int64_t i = 0; i < g.count; ++i) {
      const RowKeys& r = g.rows[i];
      if (last_position(r) < p0 || first_position(r) >= p0 + kTile) continue;
      for (int64_t h = head * g.rep; h < (head + 1) * g.rep; ++h) {
        float* dst = g.row_scores(i, h) + (p0 - g.first);
        _mm256_storeu_ps(dst, _mm256_mul_ps(dot8(g.q + i * g.q_stride + h * d, kf, d), scale));
        if (g.scoring.cap > 0.0f) {
          for (int64_t l = 0; l < kTile; ++l) dst[l] = capped(dst[l], g.scoring.cap);
        }
      }
    }
  }
}

template <class T>
SPECCHAT_AVX2 void softmax_row(const Group<T>& g, int64_t i, int64_t h) {
  const RowKeys& r = g.rows[i];
  float* e = g.row_scores(i, h);
  const int64_t n = r.count();
  for (int64_t j = 0; j < n; ++j) e[j] = e[r.position(j) - g.first];  // position(j) - first >= j: in place
  g.totals[i * g.heads + h] = softmax_numerators(e, n);
}

// o[r][c] += Σ_k e[r · e_stride + k] · vf[k][c] over `keys` values, in order, for R heads and C chunks of 8.
template <int R, int C>
SPECCHAT_AVX2 void sum_run(const float* vf, int64_t keys, const float* e, int64_t e_stride, float* o, int64_t d) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_loadu_ps(o + r * d + 8 * c);
  for (int64_t k = 0; k < keys; ++k) {
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_set1_ps(e[r * e_stride + k]);
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vf + k * kSumWidth + 8 * c), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + r * d + 8 * c, acc[r][c]);
}

template <int R>
SPECCHAT_AVX2 void sum_run_chunks(int64_t chunks, const float* vf, int64_t keys, const float* e, int64_t e_stride,
                                  float* o, int64_t d) {
  switch (chunks) {
    case 1:
      sum_run<R, 1>(vf, keys, e, e_stride, o, d);
      break;
    case 2:
      sum_run<R, 2>(vf, keys, e, e_stride, o, d);
      break;
    case 3:
      sum_run<R, 3>(vf, keys, e, e_stride, o, d);
      break;
    default:
      sum_run<R, 4>(vf, keys, e, e_stride, o, d);
      break;
  }
}

// Row i's keys at positions [begin, begin + length) (its j from j0 on) that lie in the block [t0, t1) of vf.
template <class T>
SPECCHAT_AVX2 void sum_segment(const Group<T>& g, int64_t head, int64_t c0, int64_t chunks, const float* vf, int64_t t0,
                               int64_t t1, int64_t i, int64_t begin, int64_t length, int64_t j0) {
  const int64_t a = std::max(begin, t0), b = std::min(begin + length, t1);
  if (a >= b) return;
  const int64_t d = g.pools->d;
  for (int64_t h = head * g.rep; h < (head + 1) * g.rep; h += 3) {
    const float* e = g.row_scores(i, h) + j0 + (a - begin);
    float* o = g.out + i * g.out_stride + h * d + c0;
    const float* v = vf + (a - t0) * kSumWidth;
    switch (std::min<int64_t>(3, (head + 1) * g.rep - h)) {
      case 1:
        sum_run_chunks<1>(chunks, v, b - a, e, g.stride, o, d);
        break;
      case 2:
        sum_run_chunks<2>(chunks, v, b - a, e, g.stride, o, d);
        break;
      default:
        sum_run_chunks<3>(chunks, v, b - a, e, g.stride, o, d);
        break;
    }
  }
}

// Output elements [c0, c0 + kSumWidth) of KV head `head`'s query heads, for rows [i0, i1) of the group.
template <class T>
SPECCHAT_AVX2 void weigh_block(const Group<T>& g, int64_t head, int64_t c0, int64_t i0, int64_t i1) {
  const int64_t d = g.pools->d, width = std::min(kSumWidth, d - c0), chunks = width / 8;
  thread_local std::vector<float> store;
  thread_local std::vector<int64_t> cursor;
  store.resize(static_cast<size_t>(kSumKeys * kSumWidth));
  cursor.assign(static_cast<size_t>(i1 - i0), 0);
  float* vf = store.data();
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t h = head * g.rep; h < (head + 1) * g.rep; ++h) {
      float* o = g.out + i * g.out_stride + h * d + c0;
      std::fill(o, o + width, 0.0f);
    }
  }
  int64_t lo = g.end, hi = g.first;  // the block's rows' keys lie in [lo, hi)
  for (int64_t i = i0; i < i1; ++i) {
    lo = std::min(lo, first_position(g.rows[i]));
    hi = std::max(hi, last_position(g.rows[i]) + 1);
  }
  for (int64_t t0 = lo; t0 < hi; t0 += kSumKeys) {
    const int64_t t1 = std::min(hi, t0 + kSumKeys);
    for (int64_t p = t0; p < t1; ++p) {
      if (p + kAheadValues < hi) {
        const char* ahead = reinterpret_cast<const char*>(g.pools->value(head, p + kAheadValues) + c0);
        for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
      const T* src = g.pools->value(head, p) + c0;
      for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(vf + (p - t0) * kSumWidth + 8 * c, load8(src + 8 * c));
    }
    for (int64_t i = i0; i < i1; ++i) {  // the committed keys, then the pass's own: the row's key order
      const RowKeys& r = g.rows[i];
      sum_segment(g, head, c0, chunks, vf, t0, t1, i, r.low, r.committed, 0);
      if (!r.index) {
        sum_segment(g, head, c0, chunks, vf, t0, t1, i, r.fresh, r.extra, r.committed);
        continue;
      }
      int64_t& at = cursor[static_cast<size_t>(i - i0)];
      for (; at < r.extra && r.index[at] < t1; ++at) {
        sum_segment(g, head, c0, chunks, vf, t0, t1, i, r.index[at], 1, r.committed + at);
      }
    }
  }
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t h = head * g.rep; h < (head + 1) * g.rep; ++h) {
      float* o = g.out + i * g.out_stride + h * d + c0;
      const __m256 total = _mm256_set1_ps(g.totals[i * g.heads + h]);
      for (int64_t c = 0; c < width; c += 8) _mm256_storeu_ps(o + c, _mm256_div_ps(_mm256_loadu_ps(o + c), total));
    }
  }
}

template <class T>
void run_group(const Group<T>& g) {
  const int64_t d = g.pools->d, tiles = (g.end - g.first + kTile - 1) / kTile;
  const int64_t blocks = (tiles + kScoreTiles - 1) / kScoreTiles, parts = (d + kSumWidth - 1) / kSumWidth;
  const int64_t row_blocks = (g.count + kSumRows - 1) / kSumRows;
  // Step 3's work item: KV head `head`'s output elements of part `part` for the rows of row block `rb`.
  auto weigh = [&](int64_t head, int64_t part, int64_t rb) {
    weigh_block(g, head, part * kSumWidth, rb * kSumRows, std::min(g.count, (rb + 1) * kSumRows));
  };
  if (g.count * g.heads * (g.end - g.first) < kHeadSplitWork) {
    // Too little for three barriers (a short context): each thread takes whole KV heads instead, all three steps
    // of a head in a row. The same functions on the same items: the same bits as the barriered path.
    at::parallel_for(0, g.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t head = begin; head < end; ++head) {
        for (int64_t block = 0; block < blocks; ++block) score_block(g, head, block);
        for (int64_t i = 0; i < g.count; ++i) {
          for (int64_t h = head * g.rep; h < (head + 1) * g.rep; ++h) softmax_row(g, i, h);
        }
        for (int64_t part = 0; part < parts; ++part) {
          for (int64_t rb = 0; rb < row_blocks; ++rb) weigh(head, part, rb);
        }
      }
    });
    return;
  }
  const int64_t scoring = g.kv_heads * blocks, softmax = g.count * g.heads, sums = g.kv_heads * parts * row_blocks;
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < scoring; ++item) score_block(g, item / blocks, item % blocks);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < softmax; ++item) softmax_row(g, item / g.heads, item % g.heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < sums; ++item) {
      weigh(item / (parts * row_blocks), item / row_blocks % parts, item % row_blocks);
    }
  }
}
#endif

template <class T>
void rows_scalar(const Pools<T>& pools, const RowKeys* rows, int64_t n, int64_t kv_heads, int64_t rep, Scoring scoring,
                 const float* q, int64_t q_stride, float* out, int64_t out_stride) {
  const int64_t d = pools.d;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, g = item % kv_heads;
      const RowKeys& keys = rows[i];
      if (static_cast<int64_t>(scratch.size()) < rep * keys.count())
        scratch.resize(static_cast<size_t>(rep * keys.count()));
      row_scalar(q + i * q_stride + g * rep * d, rep, pools, keys, g, scoring, scratch.data(),
                 out + i * out_stride + g * rep * d, d);
    }
  });
}

}  // namespace

template <class T>
void attend_rows(bool vector, const Pools<T>& pools, const RowKeys* rows, int64_t n, int64_t kv_heads, int64_t rep,
                 Scoring scoring, const float* q, int64_t q_stride, float* out, int64_t out_stride,
                 std::vector<float>& work) {
#ifdef SPECCHAT_X86
  if (vector) {
    const int64_t heads = kv_heads * rep;
    int64_t lo = first_position(rows[0]), hi = last_position(rows[0]) + 1;
    for (int64_t i = 1; i < n; ++i) {
      lo = std::min(lo, first_position(rows[i]));
      hi = std::max(hi, last_position(rows[i]) + 1);
    }
    const int64_t widest = (hi - lo + kTile - 1) / kTile * kTile;
    const int64_t per_group = std::clamp<int64_t>(kBudget / (heads * (widest + 1)), 1, n);
    for (int64_t i0 = 0; i0 < n; i0 += per_group) {
      Group<T> g;
      g.pools = &pools;
      g.rows = rows + i0;
      g.count = std::min(per_group, n - i0);
      g.kv_heads = kv_heads;
      g.rep = rep;
      g.heads = heads;
      g.scoring = scoring;
      g.q = q + i0 * q_stride;
      g.q_stride = q_stride;
      g.out = out + i0 * out_stride;
      g.out_stride = out_stride;
      g.first = first_position(g.rows[0]);
      g.end = last_position(g.rows[0]) + 1;
      for (int64_t i = 1; i < g.count; ++i) {
        g.first = std::min(g.first, first_position(g.rows[i]));
        g.end = std::max(g.end, last_position(g.rows[i]) + 1);
      }
      g.stride = (g.end - g.first + kTile - 1) / kTile * kTile;
      const int64_t size = g.count * heads * (g.stride + 1);
      // Reserved once at the budget: grown pass by pass as the context grows, each larger copy left the last one
      // as a hole in the allocator's arena (the pages reserved and not yet used are not resident).
      if (static_cast<int64_t>(work.capacity()) < size) work.reserve(static_cast<size_t>(std::max(size, kBudget)));
      if (static_cast<int64_t>(work.size()) < size) work.resize(static_cast<size_t>(size));
      g.scores = work.data();
      g.totals = g.scores + g.count * heads * g.stride;
      run_group(g);
    }
    return;
  }
#endif
  (void)vector;
  (void)work;
  rows_scalar(pools, rows, n, kv_heads, rep, scoring, q, q_stride, out, out_stride);
}

template void attend_rows<Half>(bool, const Pools<Half>&, const RowKeys*, int64_t, int64_t, int64_t, Scoring,
                                const float*, int64_t, float*, int64_t, std::vector<float>&);
template void attend_rows<uint16_t>(bool, const Pools<uint16_t>&, const RowKeys*, int64_t, int64_t, int64_t, Scoring,
                                    const float*, int64_t, float*, int64_t, std::vector<float>&);
template void attend_rows<float>(bool, const Pools<float>&, const RowKeys*, int64_t, int64_t, int64_t, Scoring,
                                 const float*, int64_t, float*, int64_t, std::vector<float>&);

}  // namespace specchat_attention
