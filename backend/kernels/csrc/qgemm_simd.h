// The vector kernels, written once against a traits class V (qgemm_avx2.cpp, qgemm_avx512.h) and compiled per
// ISA: the including file defines SC_TARGET (the function target attribute) and V. No standard-library code
// below, so nothing here is instantiated for a target the CPU may lack outside the ISA's own functions.
//
// A tile is V::G groups of 8 columns (one vector of 8·G float lanes) × R activation rows. Each block of the
// weight is loaded and unpacked once per tile and used for its R rows; each row's int sums are exact and its
// float accumulator (lane = column) is updated once per block by the same instructions whatever R is, so a
// row's result never depends on the tile shape, the other rows or the column split.
//
// Integer bounds (AVX2 sums maddubs pairs in int16 before madd): activation codes are in [-127, 127], so
// 8 Q4 slices (≤ 8·2·15·127 = 30480), 4 Q5 slices (31496) or 2 Q6 slices (32004) fit an int16 lane.
#pragma once

#include "qgemm_layout.h"

namespace specchat::detail {

template <class V>
struct Kern {
  using vi = typename V::vi;
  using vf = typename V::vf;

  struct Tile {
    const uint8_t* plane[4];    // each plane's record of (first group, block 0)
    ptrdiff_t group_stride[4];  // bytes from the first group's record to the second's (0: one group)
    int64_t blocks;
  };

  // ---- legacy blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1): codes of one vector k → slices k and k + 4 ----
  template <int K, int R, bool Five>
  SC_FN static void step32(const Tile& t, const uint8_t* qs, const uint8_t* qh, const int8_t* const* act_row, vi* lo,
                           vi* hi) {
    const vi v = V::load(qs + 32 * K, t.group_stride[0]);
    vi a = V::lo4(v), b = V::hi4(v);
    if constexpr (Five) {
      const vi h = V::load(qh, t.group_stride[1]);
      a = V::or_(a, V::template bit4<K>(h));
      b = V::or_(b, V::template bit4<K + 4>(h));
    }
    for (int r = 0; r < R; ++r) {
      lo[r] = V::dot(lo[r], a, V::bcast4(act_row[r] + 4 * K));
      hi[r] = V::dot(hi[r], b, V::bcast4(act_row[r] + 16 + 4 * K));
    }
  }

  // Q4_0 (Min = false, Five = false), Q4_1, Q5_0, Q5_1.
  template <int R, bool Min, bool Five>
  SC_TARGET static void legacy(const Tile& t, const Acts& a, int64_t row0, vf* out) {
    const int d_plane = Five ? 2 : 1;  // the plane of d (and m)
    const size_t d_record_bytes = Min ? 32 : 16;
    const int32_t off = Min ? 0 : (Five ? 16 : 8);
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const int64_t blocks = t.blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = t.plane[0] + b * 128;
      const uint8_t* qh = Five ? t.plane[1] + b * 32 : nullptr;
      const int8_t* act_row[R];
      vi lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        act_row[r] = a.qs + (row0 + r) * a.K + b * 32;
        lo[r] = V::zero_acc();
        hi[r] = V::zero_acc();
      }
      step32<0, R, Five>(t, qs, qh, act_row, lo, Five ? hi : lo);
      step32<1, R, Five>(t, qs, qh, act_row, lo, Five ? hi : lo);
      step32<2, R, Five>(t, qs, qh, act_row, lo, Five ? hi : lo);
      step32<3, R, Five>(t, qs, qh, act_row, lo, Five ? hi : lo);
      const uint8_t* d_record = t.plane[d_plane] + b * d_record_bytes;
      const vf d_weight = V::load_h8(d_record, t.group_stride[d_plane]);
      for (int r = 0; r < R; ++r) {
        const int64_t act_block = (row0 + r) * blocks + b;
        vi isum = V::finish(lo[r]);
        if constexpr (Five) isum = V::add32(isum, V::finish(hi[r]));
        if constexpr (!Min) isum = V::sub32(isum, V::set1_32(a.sum[act_block] * off));
        acc[r] = V::fma(V::cvt(isum), V::mul(d_weight, V::set1f(a.d[act_block])), acc[r]);
      }
      if constexpr (Min) {
        const vf m_weight = V::load_h8(d_record + 16, t.group_stride[d_plane]);
        for (int r = 0; r < R; ++r) acc[r] = V::fma(m_weight, V::set1f(a.s[(row0 + r) * blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  template <int R>
  SC_TARGET static void q8_0(const Tile& t, const Acts& a, int64_t row0, vf* out) {
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const int64_t blocks = t.blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = t.plane[0] + b * 256;
      const int8_t* act_row[R];
      vi s[R];
      for (int r = 0; r < R; ++r) {
        act_row[r] = a.qs + (row0 + r) * a.K + b * 32;
        s[r] = V::zero_i();
      }
      for (int k = 0; k < 8; ++k) {
        const typename V::W8 w = V::prep8(V::load(qs + 32 * k, t.group_stride[0]));
        for (int r = 0; r < R; ++r) s[r] = V::dot8(s[r], w, V::bcast4(act_row[r] + 4 * k));
      }
      const vf d_weight = V::load_h8(t.plane[1] + b * 16, t.group_stride[1]);
      for (int r = 0; r < R; ++r) {
        const int64_t act_block = (row0 + r) * blocks + b;
        acc[r] = V::fma(V::cvt(V::fix8(s[r], a.sum[act_block])), V::mul(d_weight, V::set1f(a.d[act_block])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  // ---- K-quants: super-blocks of 256 = 8 sub-blocks of 32 ----
  // Q4_K / Q5_K sub-block j of one super-block: isum[r] += scale_j · (codes · activations).
  template <int R, bool Five>
  SC_FN static void sub_k45(const Tile& t, const uint8_t* qs, const uint8_t* qh, const uint8_t* scales_mins, int j,
                            const int8_t* const* act_row, vi* isum) {
    vi lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = V::zero_acc();
      hi[r] = V::zero_acc();
    }
    const int8_t* act_sub[R];
    for (int r = 0; r < R; ++r) act_sub[r] = act_row[r] + 32 * j;
    step32<0, R, Five>(t, qs + 128 * j, qh + 32 * j, act_sub, lo, Five ? hi : lo);
    step32<1, R, Five>(t, qs + 128 * j, qh + 32 * j, act_sub, lo, Five ? hi : lo);
    step32<2, R, Five>(t, qs + 128 * j, qh + 32 * j, act_sub, lo, Five ? hi : lo);
    step32<3, R, Five>(t, qs + 128 * j, qh + 32 * j, act_sub, lo, Five ? hi : lo);
    const vi sc = (j & 1) ? V::template scale_u8<1>(scales_mins + 16 * (j >> 1), t.group_stride[Five ? 3 : 2])
                          : V::template scale_u8<0>(scales_mins + 16 * (j >> 1), t.group_stride[Five ? 3 : 2]);
    for (int r = 0; r < R; ++r) {
      isum[r] = V::add32(isum[r], V::finish_scaled(lo[r], sc));
      if constexpr (Five) isum[r] = V::add32(isum[r], V::finish_scaled(hi[r], sc));
    }
  }

  template <int R, bool Five>
  SC_TARGET static void k45(const Tile& t, const Acts& a, int64_t row0, vf* out) {
    const int dm_plane = Five ? 2 : 1, scales_plane = Five ? 3 : 2;
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const int64_t blocks = t.blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = t.plane[0] + b * 1024;
      const uint8_t* qh = Five ? t.plane[1] + b * 256 : qs;
      const uint8_t* scales_mins = t.plane[scales_plane] + b * 128;
      const int8_t* act_row[R];
      vi isum[R];
      for (int r = 0; r < R; ++r) {
        act_row[r] = a.qs + (row0 + r) * a.K + b * 256;
        isum[r] = V::zero_i();
      }
      for (int j = 0; j < 8; ++j) sub_k45<R, Five>(t, qs, qh, scales_mins, j, act_row, isum);
      vi mins[4];
      for (int p = 0; p < 4; ++p) mins[p] = V::pair16_u8(scales_mins + 64 + 16 * p, t.group_stride[scales_plane]);
      const uint8_t* dm = t.plane[dm_plane] + b * 32;
      const vf d_weight = V::load_h8(dm, t.group_stride[dm_plane]),
               dmin = V::load_h8(dm + 16, t.group_stride[dm_plane]);
      for (int r = 0; r < R; ++r) {
        const int16_t* bs = a.bs32 + ((row0 + r) * blocks + b) * 8;
        vi msum = V::madd16(mins[0], V::bcast_pair16(bs));
        for (int p = 1; p < 4; ++p) msum = V::add32(msum, V::madd16(mins[p], V::bcast_pair16(bs + 2 * p)));
        const vf d_act = V::set1f(a.d[(row0 + r) * blocks + b]);
        acc[r] = V::fma(V::cvt(isum[r]), V::mul(d_weight, d_act), acc[r]);
        acc[r] = V::fnma(V::cvt(msum), V::mul(dmin, d_act), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  // Q6_K: codes = low nibble | bits 4..5; sub-blocks of 16 (slices 0..3 and 4..7 of each 32).
  template <int K, int R>
  SC_FN static void step6(const Tile& t, const uint8_t* ql, const vi& h0, const vi& h1, const int8_t* const* act_row,
                          vi* lo, vi* hi) {
    const vi v = V::load(ql + 32 * K, t.group_stride[0]);
    const vi a = V::or_(V::lo4(v), V::template bits45<K>(h0));
    const vi b = V::or_(V::hi4(v), V::template bits45<K>(h1));
    for (int r = 0; r < R; ++r) {
      lo[r] = V::dot(lo[r], a, V::bcast4(act_row[r] + 4 * K));
      hi[r] = V::dot(hi[r], b, V::bcast4(act_row[r] + 16 + 4 * K));
    }
  }

  template <int R>
  SC_TARGET static void q6_k(const Tile& t, const Acts& a, int64_t row0, vf* out) {
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    const int64_t blocks = t.blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* ql = t.plane[0] + b * 1024;
      const uint8_t* qh = t.plane[1] + b * 512;
      const uint8_t* sc = t.plane[3] + b * 128;
      const int8_t* act_row[R];
      vi isum[R];
      for (int r = 0; r < R; ++r) {
        act_row[r] = a.qs + (row0 + r) * a.K + b * 256;
        isum[r] = V::zero_i();
      }
      for (int j = 0; j < 8; ++j) {
        const vi h0 = V::load(qh + 64 * j, t.group_stride[1]), h1 = V::load(qh + 64 * j + 32, t.group_stride[1]);
        const int8_t* act_sub[R];
        vi lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          act_sub[r] = act_row[r] + 32 * j;
          lo[r] = V::zero_acc();
          hi[r] = V::zero_acc();
        }
        step6<0, R>(t, ql + 128 * j, h0, h1, act_sub, lo, hi);
        step6<1, R>(t, ql + 128 * j, h0, h1, act_sub, lo, hi);
        const vi s0 = V::template scale_s8<0>(sc + 16 * j, t.group_stride[3]);
        const vi s1 = V::template scale_s8<1>(sc + 16 * j, t.group_stride[3]);
        for (int r = 0; r < R; ++r) {
          isum[r] = V::add32(isum[r], V::add32(V::finish_scaled(lo[r], s0), V::finish_scaled(hi[r], s1)));
          lo[r] = V::zero_acc();
          hi[r] = V::zero_acc();
        }
        step6<2, R>(t, ql + 128 * j, h0, h1, act_sub, lo, hi);
        step6<3, R>(t, ql + 128 * j, h0, h1, act_sub, lo, hi);
        for (int r = 0; r < R; ++r)
          isum[r] = V::add32(isum[r], V::add32(V::finish_scaled(lo[r], s0), V::finish_scaled(hi[r], s1)));
      }
      const vf d_weight = V::load_h8(t.plane[2] + b * 16, t.group_stride[2]);
      for (int r = 0; r < R; ++r) {
        // the codes' offset of 32: isum -= 32 · Σ_j scale_j · (sum of the activation codes of sub-block j)
        const int16_t* bs = a.bs16 + ((row0 + r) * blocks + b) * 16;
        vi osum = V::madd16(V::pair16_s8(sc, t.group_stride[3]), V::bcast_pair16(bs));
        for (int p = 1; p < 8; ++p)
          osum = V::add32(osum, V::madd16(V::pair16_s8(sc + 16 * p, t.group_stride[3]), V::bcast_pair16(bs + 2 * p)));
        const vi fixed = V::sub32(isum[r], V::template slli32<5>(osum));
        acc[r] = V::fma(V::cvt(fixed), V::mul(d_weight, V::set1f(a.d[(row0 + r) * blocks + b])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }

  // ---- float weights: 4 chains per (row, column) over inputs k ≡ 0..3 (mod 4), summed (c0 + c1) + (c2 + c3) ----
  template <GgmlType T>
  SC_FN static vf wload(const uint8_t* p, ptrdiff_t group_stride) {
    if constexpr (T == GgmlType::F32)
      return V::load_f8(p, group_stride);
    else if constexpr (T == GgmlType::F16)
      return V::load_h8(p, group_stride);
    else
      return V::load_bf8(p, group_stride);
  }

  template <int I, int R, GgmlType T>
  SC_FN static void fstep(const Tile& t, int64_t k, const float* const* x_rows, vf (*acc)[4]) {
    constexpr size_t record = T == GgmlType::F32 ? 32 : 16;
    const vf w = wload<T>(t.plane[0] + (k + I) * record, t.group_stride[0]);
    for (int r = 0; r < R; ++r) acc[r][I] = V::fma(w, V::set1f(x_rows[r][k + I]), acc[r][I]);
  }

  template <int R, GgmlType T>
  SC_TARGET static void floats(const Tile& t, const Acts& a, int64_t row0, vf* out) {
    vf acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = V::zero_f();
    const int64_t K = t.blocks;
    const float* x_rows[R];
    for (int r = 0; r < R; ++r) x_rows[r] = a.x + (row0 + r) * a.K;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      fstep<0, R, T>(t, k, x_rows, acc);
      fstep<1, R, T>(t, k, x_rows, acc);
      fstep<2, R, T>(t, k, x_rows, acc);
      fstep<3, R, T>(t, k, x_rows, acc);
    }
    if (k < K) fstep<0, R, T>(t, k, x_rows, acc);
    if (k + 1 < K) fstep<1, R, T>(t, k, x_rows, acc);
    if (k + 2 < K) fstep<2, R, T>(t, k, x_rows, acc);
    for (int r = 0; r < R; ++r) out[r] = V::add_f(V::add_f(acc[r][0], acc[r][1]), V::add_f(acc[r][2], acc[r][3]));
  }

  template <int R>
  SC_TARGET static void tile(GgmlType type, const Tile& t, const Acts& a, int64_t row0, float* y, int64_t ldy,
                             int ncols) {
    vf out[R];
    for (int r = 0; r < R; ++r) out[r] = V::zero_f();
    switch (type) {
      case GgmlType::Q4_0:
        legacy<R, false, false>(t, a, row0, out);
        break;
      case GgmlType::Q4_1:
        legacy<R, true, false>(t, a, row0, out);
        break;
      case GgmlType::Q5_0:
        legacy<R, false, true>(t, a, row0, out);
        break;
      case GgmlType::Q5_1:
        legacy<R, true, true>(t, a, row0, out);
        break;
      case GgmlType::Q8_0:
        q8_0<R>(t, a, row0, out);
        break;
      case GgmlType::Q4_K:
        k45<R, false>(t, a, row0, out);
        break;
      case GgmlType::Q5_K:
        k45<R, true>(t, a, row0, out);
        break;
      case GgmlType::Q6_K:
        q6_k<R>(t, a, row0, out);
        break;
      case GgmlType::F32:
        floats<R, GgmlType::F32>(t, a, row0, out);
        break;
      case GgmlType::F16:
        floats<R, GgmlType::F16>(t, a, row0, out);
        break;
      case GgmlType::BF16:
        floats<R, GgmlType::BF16>(t, a, row0, out);
        break;
    }
    for (int r = 0; r < R; ++r) V::store(y + (row0 + r) * ldy, out[r], ncols);
  }

  // Column tiles [t0, t1): tile i covers groups G·i .. G·i + G - 1.
  SC_TARGET static void run(const Job& job, int64_t t0, int64_t t1) {
    const Packed& w = *job.w;
    const Acts& a = *job.a;
    const bool floats_ = a.fmt == ActFormat::F32;
    const int rmax = floats_ ? V::kRowsF : V::kRowsQ;
    for (int64_t c0 = 0; c0 < a.m; c0 += kRowChunk) {
      const int64_t c1 = c0 + kRowChunk < a.m ? c0 + kRowChunk : a.m;
      for (int64_t ti = t0; ti < t1; ++ti) {
        const int64_t g0 = ti * V::G;
        const bool pair = V::G > 1 && g0 + 1 < w.groups;
        Tile t;
        t.blocks = w.blocks;
        for (int p = 0; p < 4; ++p) {
          t.plane[p] = w.plane[p] ? w.plane[p] + g0 * w.blocks * static_cast<int64_t>(w.record_bytes[p]) : nullptr;
          t.group_stride[p] = pair ? static_cast<ptrdiff_t>(w.blocks * static_cast<int64_t>(w.record_bytes[p])) : 0;
        }
        const int64_t left = w.rows - g0 * kGroup;
        const int ncols = static_cast<int>(left < 8 * V::G ? left : 8 * V::G);
        float* y = job.y + g0 * kGroup;
        int64_t r = c0;
        if (rmax == 4)
          for (; r + 4 <= c1; r += 4) tile<4>(w.type, t, a, r, y, job.ldy, ncols);
        for (; r + 2 <= c1; r += 2) tile<2>(w.type, t, a, r, y, job.ldy, ncols);
        for (; r < c1; ++r) tile<1>(w.type, t, a, r, y, job.ldy, ncols);
      }
    }
  }
};

}  // namespace specchat::detail
