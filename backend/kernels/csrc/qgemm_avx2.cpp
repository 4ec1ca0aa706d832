// The AVX2 path (AVX2 + FMA + F16C, chosen at run time; this file's functions carry the target attribute, the
// library itself is built for baseline x86-64): qgemm_simd.h's kernels over 256-bit vectors, one group of 8
// columns per vector, and the activations' quantisation.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qgemm_layout.h"

#define SC_TARGET __attribute__((target("avx2,fma,f16c")))
#define SC_FN __attribute__((target("avx2,fma,f16c"), always_inline)) inline

#include "qgemm_simd.h"

namespace specchat::detail {
namespace {

struct Avx2 {
  using vi = __m256i;
  using vf = __m256;
  static constexpr int G = 1;       // groups of 8 columns per vector
  static constexpr int kRowsQ = 4;  // activation rows per tile: quantised weights, float weights
  static constexpr int kRowsF = 2;

  SC_FN static vi load(const uint8_t* p, ptrdiff_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  SC_FN static vf load_h8(const uint8_t* p, ptrdiff_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SC_FN static vf load_bf8(const uint8_t* p, ptrdiff_t) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  SC_FN static vf load_f8(const uint8_t* p, ptrdiff_t) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }

  SC_FN static vi lo4(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  SC_FN static vi hi4(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  template <int S>  // (bit S of each byte) << 4
  SC_FN static vi bit4(vi h) {
    if constexpr (S <= 4)
      return _mm256_and_si256(_mm256_slli_epi16(h, 4 - S), _mm256_set1_epi8(0x10));
    else
      return _mm256_and_si256(_mm256_srli_epi16(h, S - 4), _mm256_set1_epi8(0x10));
  }
  template <int T>  // (bits 2T..2T+1 of each byte) << 4
  SC_FN static vi bits45(vi h) {
    if constexpr (T <= 2)
      return _mm256_and_si256(_mm256_slli_epi16(h, 4 - 2 * T), _mm256_set1_epi8(0x30));
    else
      return _mm256_and_si256(_mm256_srli_epi16(h, 2 * T - 4), _mm256_set1_epi8(0x30));
  }
  SC_FN static vi or_(vi a, vi b) { return _mm256_or_si256(a, b); }
  SC_FN static vi add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
  SC_FN static vi sub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
  SC_FN static vi set1_32(int32_t v) { return _mm256_set1_epi32(v); }
  template <int N>
  SC_FN static vi slli32(vi v) {
    return _mm256_slli_epi32(v, N);
  }
  SC_FN static vi zero_i() { return _mm256_setzero_si256(); }
  SC_FN static vi bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  // Dot accumulators: int16 pairs of maddubs (unsigned codes × signed activations), reduced by madd.
  SC_FN static vi zero_acc() { return _mm256_setzero_si256(); }
  SC_FN static vi dot(vi acc, vi w, vi a) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a)); }
  SC_FN static vi finish(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  SC_FN static vi finish_scaled(vi acc, vi sc) { return _mm256_madd_epi16(acc, sc); }
  // Scale of sub-block 2p + H of each column from a [8 cols][2] byte record, as int16 pairs (s, s).
  template <int H>
  SC_FN static __m128i dup(const uint8_t* p) {
    const __m128i m = H ? _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15)
                        : _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m);
  }
  template <int H>
  SC_FN static vi scale_u8(const uint8_t* p, ptrdiff_t) {
    return _mm256_cvtepu8_epi16(dup<H>(p));
  }
  template <int H>
  SC_FN static vi scale_s8(const uint8_t* p, ptrdiff_t) {
    return _mm256_cvtepi8_epi16(dup<H>(p));
  }
  SC_FN static vi pair16_u8(const uint8_t* p, ptrdiff_t) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SC_FN static vi pair16_s8(const uint8_t* p, ptrdiff_t) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SC_FN static vi bcast_pair16(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  SC_FN static vi madd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }

  // Q8_0's signed codes: |w| × (a with w's sign), one int32 sum per 4 inputs.
  struct W8 {
    vi abs, w;
  };
  SC_FN static W8 prep8(vi w) { return {_mm256_sign_epi8(w, w), w}; }
  SC_FN static vi dot8(vi acc, const W8& w, vi a) {
    const vi p = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(a, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  SC_FN static vi fix8(vi isum, int32_t) { return isum; }

  SC_FN static vf zero_f() { return _mm256_setzero_ps(); }
  SC_FN static vf cvt(vi v) { return _mm256_cvtepi32_ps(v); }
  SC_FN static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  SC_FN static vf add_f(vf a, vf b) { return _mm256_add_ps(a, b); }
  SC_FN static vf set1f(float v) { return _mm256_set1_ps(v); }
  SC_FN static vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  SC_FN static vf fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
  SC_FN static void store(float* y, vf v, int n) {
    if (n >= 8) {
      _mm256_storeu_ps(y, v);
      return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int i = 0; i < n; ++i) y[i] = tmp[i];
  }
};

// Codes of n (32 or 256) inputs: the scalar path's arithmetic (qgemm_scalar.cpp) in vectors, the same results.
SC_TARGET void quantize_block(const float* x, int n, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  *d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), id);
      t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
      v[j] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(p, order));
  }
}

}  // namespace

void quantize_rows_avx2(Acts& a, const float* x, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) quantize_row(a, x + r * a.K, r, quantize_block);
}

void run_avx2(const Job& job, int64_t t0, int64_t t1) { Kern<Avx2>::run(job, t0, t1); }

}  // namespace specchat::detail
