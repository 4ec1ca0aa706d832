// Attention's building blocks, read straight from the cache pools (float16, bfloat16 or float32), for the native
// model: which keys a row sees (RowKeys) and where they are (Pools), the scalar row-by-row version (row_scalar:
// scores in key order, std::exp), and the vector pieces the pass in attention_pass.h is made of (load8, exp8, the
// softmax's numerators). attention_pass.h states the arithmetic per row and why it does not depend on the pass
// around it.
//
// Each row is computed from its query and its keys and values in their order (a chain's run of positions, or a
// tree node's prefix and ancestors) only. So a verification pass gives every token exactly the one-token pass's
// result (tests/backend/kernels/test_native_model.py, test_attention_rows.py), which is what lets verification
// keep a draft only when it equals the target's own token. Both versions differ from ATen's softmax(q·kᵀ)·v in
// the last bits only; with AVX2, FMA or F16C missing (or off x86) the scalar version runs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "qgemm_layout.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECCHAT_X86 1
#endif

namespace specchat_attention {

// The keys one row sees, j = 0 .. count()-1, in order: `committed` positions low, low + 1, ... of the committed
// prefix (its window of it), then `extra` positions among the pass's own rows: index[0 ..] (a tree node: its
// ancestors and itself, in row order) or fresh, fresh + 1, ... (a chain). Positions only grow with j.
struct RowKeys {
  int64_t low = 0, committed = 0;
  const int64_t* index = nullptr;
  int64_t fresh = 0, extra = 0;
  int64_t count() const { return committed + extra; }
  int64_t position(int64_t j) const {
    if (j < committed) return low + j;
    return index ? index[j - committed] : fresh + (j - committed);
  }
};

// One layer's cache pools: position p is in slot map[p], or read_start + p when the sequence's blocks are one
// consecutive run (map == nullptr). T: the pools' element, Half (float16 bits), uint16_t (bfloat16 bits) or float.
template <class T>
struct Pools {
  const T* k = nullptr;  // the K pool of one layer, [kv_heads, slots, d]
  const T* v = nullptr;
  int64_t slots = 0, d = 0;
  const int64_t* map = nullptr;
  int64_t read_start = 0;
  int64_t slot(int64_t position) const { return map ? map[position] : read_start + position; }
  const T* key(int64_t head, int64_t position) const { return k + (head * slots + slot(position)) * d; }
  const T* value(int64_t head, int64_t position) const { return v + (head * slots + slot(position)) * d; }
};

// A float16 value's bits (IEEE binary16), the pools' element where the cache is float16 (a GGUF's, as llama.cpp's).
struct Half {
  uint16_t bits;
};

inline float widen(Half h) { return specchat::detail::half_to_float(h.bits); }  // exact, as F16C's vcvtph2ps

inline float widen(uint16_t bits) {  // bfloat16 -> float32 (exact)
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
inline float widen(float x) { return x; }

// A score after the scale: soft-capped (tanh(s / c) · c) when cap > 0 (gemma2), else as it is.
inline float capped(float score, float cap) { return cap > 0.0f ? std::tanh(score / cap) * cap : score; }

// How one query row scores its keys.
struct Scoring {
  float scale = 1.0f;  // 1/√head_dim or the model's own
  float cap = 0.0f;    // logit soft cap; 0: none
};

// The portable version, one row at a time (scalar sums in key order, std::exp): runs where AVX2, FMA or F16C do not,
// and differs from the vector version (attention_pass.h) in the last bits. q [rep, d], out [rep rows of out_stride];
// scratch holds rep · keys.count() floats.
template <class T>
void row_scalar(const float* q, int64_t rep, const Pools<T>& pools, const RowKeys& keys, int64_t head, Scoring scoring,
                float* scratch, float* out, int64_t out_stride) {
  const int64_t d = pools.d, n = keys.count();
  for (int64_t r = 0; r < rep; ++r) {
    float* e = scratch + r * n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const T* k = pools.key(head, keys.position(j));
      float dot = 0.0f;
      for (int64_t t = 0; t < d; ++t) dot = dot + q[r * d + t] * widen(k[t]);
      e[j] = capped(dot * scoring.scale, scoring.cap);
      top = std::max(top, e[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      e[j] = std::exp(e[j] - top);
      total = total + e[j];
    }
    float* o = out + r * out_stride;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = pools.value(head, keys.position(j));
      for (int64_t t = 0; t < d; ++t) o[t] = o[t] + e[j] * widen(v[t]);
    }
    for (int64_t t = 0; t < d; ++t) o[t] = o[t] / total;
  }
}

#ifdef SPECCHAT_X86
#define SPECCHAT_AVX2 __attribute__((target("avx2,fma,f16c")))

SPECCHAT_AVX2 inline __m256 load8(const Half* p) {  // 8 float16 -> float32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

SPECCHAT_AVX2 inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> float32 (exact)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
SPECCHAT_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

SPECCHAT_AVX2 inline float lanes_sum(__m256 v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// exp(x) for x <= 0 (Cephes' expf: x = n·ln2 + f, |f| <= ln2/2, a degree-6 polynomial in f, times 2^n); 0 below
// -87.3, where the result would be subnormal.
SPECCHAT_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

// e <- exp(e - max e) over n scores, in place; returns their sum (8 lanes in key order, then lanes_sum).
SPECCHAT_AVX2 inline float softmax_numerators(float* e, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, e[j]);
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), m));
    _mm256_storeu_ps(e + j, x);
    total = _mm256_add_ps(total, x);
  }
  if (j < n) {  // the tail through the same lanes, padded with keys whose weight is exactly 0
    alignas(32) float tail[8];
    for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < n ? e[j + t] : -std::numeric_limits<float>::infinity();
    const __m256 x = exp8(_mm256_sub_ps(_mm256_load_ps(tail), m));
    _mm256_store_ps(tail, x);
    total = _mm256_add_ps(total, x);
    for (int64_t t = 0; j + t < n; ++t) e[j + t] = tail[t];
  }
  return lanes_sum(total);
}

inline bool cpu_has_avx2_fma() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

// Whether the vector version runs for this head size on this CPU (else row_scalar); every AVX2 CPU has F16C.
inline bool vector_ok(int64_t d) {
#ifdef SPECCHAT_X86
  return cpu_has_avx2_fma() && d % 8 == 0;
#else
  (void)d;
  return false;
#endif
}

}  // namespace specchat_attention
