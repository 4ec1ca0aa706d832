// The AVX-512 traits for qgemm_simd.h (included by qgemm_avx512.cpp and qgemm_avx512_vnni.cpp, each with its
// own SC_TARGET / SC_FN): 512-bit vectors holding two groups of 8 columns (lanes 0..7 the first group, 8..15 the
// second; a tile's odd last group is loaded twice, group_stride = 0, and only its 8 columns stored). With VNNI, dpbusd
// sums 4 products into an int32 lane (no int16 step), scales multiply the int32 sums (mullo), and Q8_0 offsets its
// signed codes by 128 (then subtracts 128 · the activations' block sum): every integer the AVX2 path computes,
// the same, so the float operations per lane, and the results, are AVX2's bit for bit.
// Run (VNNI) on an AMD EPYC Zen 4: bit for bit the AVX2 path's results (tests/backend/kernels/test_blocks_rows.py).
#pragma once

// GCC 12.2's AVX-512 intrinsics build their "undefined" operands as `__m512 __Y = __Y;`, which -Wuninitialized
// reports at every inlined use (GCC bug 105593, fixed in 12.3 and 13): silenced for that header's lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <cstring>

namespace specchat::detail {
namespace {

template <bool Vnni>
struct Avx512 {
  using vi = __m512i;
  using vf = __m512;
  static constexpr int G = 2;
  static constexpr int kRowsQ = 4;
  static constexpr int kRowsF = 4;

  SC_FN static vi load(const uint8_t* p, ptrdiff_t group_stride) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + group_stride));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
  SC_FN static __m256i load16x2(const uint8_t* p, ptrdiff_t group_stride) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + group_stride));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
  }
  SC_FN static vf load_h8(const uint8_t* p, ptrdiff_t group_stride) {
    return _mm512_cvtph_ps(load16x2(p, group_stride));
  }
  SC_FN static vf load_bf8(const uint8_t* p, ptrdiff_t group_stride) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16x2(p, group_stride)), 16));
  }
  SC_FN static vf load_f8(const uint8_t* p, ptrdiff_t group_stride) {
    const __m256 a = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    const __m256 b = _mm256_loadu_ps(reinterpret_cast<const float*>(p + group_stride));
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
  }

  SC_FN static vi lo4(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  SC_FN static vi hi4(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  template <int S>
  SC_FN static vi bit4(vi h) {
    if constexpr (S <= 4)
      return _mm512_and_si512(_mm512_slli_epi16(h, 4 - S), _mm512_set1_epi8(0x10));
    else
      return _mm512_and_si512(_mm512_srli_epi16(h, S - 4), _mm512_set1_epi8(0x10));
  }
  template <int T>
  SC_FN static vi bits45(vi h) {
    if constexpr (T <= 2)
      return _mm512_and_si512(_mm512_slli_epi16(h, 4 - 2 * T), _mm512_set1_epi8(0x30));
    else
      return _mm512_and_si512(_mm512_srli_epi16(h, 2 * T - 4), _mm512_set1_epi8(0x30));
  }
  SC_FN static vi or_(vi a, vi b) { return _mm512_or_si512(a, b); }
  SC_FN static vi add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
  SC_FN static vi sub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
  SC_FN static vi set1_32(int32_t v) { return _mm512_set1_epi32(v); }
  template <int N>
  SC_FN static vi slli32(vi v) {
    return _mm512_slli_epi32(v, N);
  }
  SC_FN static vi zero_i() { return _mm512_setzero_si512(); }
  SC_FN static vi bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }

  SC_FN static vi zero_acc() { return _mm512_setzero_si512(); }
  SC_FN static vi dot(vi acc, vi w, vi a) {
    if constexpr (Vnni)
      return _mm512_dpbusd_epi32(acc, w, a);
    else
      return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, a));
  }
  SC_FN static vi finish(vi acc) {
    if constexpr (Vnni)
      return acc;
    else
      return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
  }
  SC_FN static vi finish_scaled(vi acc, vi sc) {
    if constexpr (Vnni)
      return _mm512_mullo_epi32(acc, sc);
    else
      return _mm512_madd_epi16(acc, sc);
  }
  // Scale of sub-block 2p + H of each column of both groups: int32 per column (VNNI) or int16 pairs (s, s).
  template <int H, bool Signed>
  SC_FN static vi scale(const uint8_t* p, ptrdiff_t group_stride) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + group_stride));
    if constexpr (Vnni) {
      const __m128i pick = H ? _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                             : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m128i both = _mm_unpacklo_epi64(_mm_shuffle_epi8(a, pick), _mm_shuffle_epi8(b, pick));
      if constexpr (Signed)
        return _mm512_cvtepi8_epi32(both);
      else
        return _mm512_cvtepu8_epi32(both);
    } else {
      const __m128i dup = H ? _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15)
                            : _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
      const __m256i both =
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_shuffle_epi8(a, dup)), _mm_shuffle_epi8(b, dup), 1);
      if constexpr (Signed)
        return _mm512_cvtepi8_epi16(both);
      else
        return _mm512_cvtepu8_epi16(both);
    }
  }
  template <int H>
  SC_FN static vi scale_u8(const uint8_t* p, ptrdiff_t group_stride) {
    return scale<H, false>(p, group_stride);
  }
  template <int H>
  SC_FN static vi scale_s8(const uint8_t* p, ptrdiff_t group_stride) {
    return scale<H, true>(p, group_stride);
  }
  SC_FN static vi pair16_u8(const uint8_t* p, ptrdiff_t group_stride) {
    return _mm512_cvtepu8_epi16(load16x2(p, group_stride));
  }
  SC_FN static vi pair16_s8(const uint8_t* p, ptrdiff_t group_stride) {
    return _mm512_cvtepi8_epi16(load16x2(p, group_stride));
  }
  SC_FN static vi bcast_pair16(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  SC_FN static vi madd16(vi a, vi b) { return _mm512_madd_epi16(a, b); }

  struct W8 {
    vi w;           // VNNI: codes + 128 as unsigned bytes; else |codes|
    __mmask64 neg;  // else: the negative codes (their activations change sign)
  };
  SC_FN static W8 prep8(vi w) {
    if constexpr (Vnni)
      return {_mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))), 0};
    else
      return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
  }
  SC_FN static vi dot8(vi acc, const W8& w, vi a) {
    if constexpr (Vnni) {
      return _mm512_dpbusd_epi32(acc, w.w, a);
    } else {
      const vi signed_a = _mm512_mask_sub_epi8(a, w.neg, _mm512_setzero_si512(), a);
      return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w.w, signed_a), _mm512_set1_epi16(1)));
    }
  }
  SC_FN static vi fix8(vi isum, int32_t asum) {
    if constexpr (Vnni)
      return _mm512_sub_epi32(isum, _mm512_set1_epi32(asum * 128));
    else
      return isum;
  }

  SC_FN static vf zero_f() { return _mm512_setzero_ps(); }
  SC_FN static vf cvt(vi v) { return _mm512_cvtepi32_ps(v); }
  SC_FN static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  SC_FN static vf add_f(vf a, vf b) { return _mm512_add_ps(a, b); }
  SC_FN static vf set1f(float v) { return _mm512_set1_ps(v); }
  SC_FN static vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  SC_FN static vf fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
  SC_FN static void store(float* y, vf v, int n) {
    if (n >= 16)
      _mm512_storeu_ps(y, v);
    else
      _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << n) - 1), v);
  }
};

}  // namespace
}  // namespace specchat::detail
