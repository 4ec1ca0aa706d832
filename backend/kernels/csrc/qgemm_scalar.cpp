// The portable path (any x86-64, or a CPU whose vector path is switched off), and the reference the vector paths
// are tested against: the same integer sums and the same float operations per (row, column), fmaf included, so
// all paths give the same bits. Also the activations' quantisation, which every path shares bit for bit.
#include <cmath>
#include <cstdint>

#include "qgemm_layout.h"

namespace specchat::detail {
namespace {

// Codes of n inputs (32 or 256): d = max|x| / 127, q = round-half-even(clamp(x · 127 / max|x|, ±127)).
void quantize_block(const float* x, int n, int8_t* q, float* d) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = std::fabs(x[i]);
    amax = v > amax ? v : amax;
  }
  *d = amax / 127.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  const float magic = 12582912.0f;  // 1.5 · 2^23: adding and subtracting it rounds to the nearest even integer
  for (int i = 0; i < n; ++i) {
    float v = x[i] * id;
    v = v > -127.0f ? v : -127.0f;
    v = v < 127.0f ? v : 127.0f;
    q[i] = static_cast<int8_t>(static_cast<int>((v + magic) - magic));
  }
}

struct Row {  // one activation row
  const Acts& a;
  int64_t i;
  const int8_t* q(int64_t b, int64_t block_inputs) const { return a.qs + i * a.K + b * block_inputs; }
};

float dot_row(const Packed& w, int64_t g, int c, const Row& row) {
  const Acts& a = row.a;
  const int64_t blocks = w.blocks, i = row.i;
  const GgmlType t = w.type;
  auto record = [&](int p, int64_t b) { return w.plane[p] + (g * blocks + b) * w.record_bytes[p]; };
  if (a.fmt == ActFormat::F32) {  // 4 chains over k mod 4, as the vector kernels
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float* x = a.x + i * a.K;
    for (int64_t k = 0; k < blocks; ++k) {
      const uint8_t* r = record(0, k);
      float v;
      if (t == GgmlType::F32)
        std::memcpy(&v, r + 4 * c, 4);
      else if (t == GgmlType::F16)
        v = half_to_float(load_u16(r + 2 * c));
      else
        v = bf16_to_float(load_u16(r + 2 * c));
      acc[k & 3] = std::fmaf(v, x[k], acc[k & 3]);
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
  }
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    switch (t) {
      case GgmlType::Q4_0:
      case GgmlType::Q4_1:
      case GgmlType::Q5_0:
      case GgmlType::Q5_1: {
        const bool five = t == GgmlType::Q5_0 || t == GgmlType::Q5_1;
        const bool min = t == GgmlType::Q4_1 || t == GgmlType::Q5_1;
        const int8_t* q = row.q(b, 32);
        int32_t isum = 0;
        for (int e = 0; e < 32; ++e) isum += (nib(record(0, b), c, e) | (five ? bit4(record(1, b), c, e) : 0)) * q[e];
        if (!min) isum -= a.sum[i * blocks + b] * (five ? 16 : 8);
        const uint8_t* dm = record(five ? 2 : 1, b);
        acc = std::fmaf(static_cast<float>(isum), h8(dm, c) * a.d[i * blocks + b], acc);
        if (min) acc = std::fmaf(h8(dm + 16, c), a.s[i * blocks + b], acc);
        break;
      }
      case GgmlType::Q8_0: {
        const int8_t* q = row.q(b, 32);
        int32_t isum = 0;
        for (int e = 0; e < 32; ++e) isum += sbyte(record(0, b), c, e) * q[e];
        acc = std::fmaf(static_cast<float>(isum), h8(record(1, b), c) * a.d[i * blocks + b], acc);
        break;
      }
      case GgmlType::Q4_K:
      case GgmlType::Q5_K: {
        const bool five = t == GgmlType::Q5_K;
        const uint8_t* scales_mins = record(five ? 3 : 2, b);
        const uint8_t* dm = record(five ? 2 : 1, b);
        const int8_t* q = row.q(b, 256);
        const int16_t* bs = a.bs32 + (i * blocks + b) * 8;
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          const int pi = 16 * (j / 2) + 2 * c + (j & 1);
          int32_t s = 0;
          for (int e = 0; e < 32; ++e)
            s += (nib(record(0, b) + 128 * j, c, e) | (five ? bit4(record(1, b) + 32 * j, c, e) : 0)) * q[32 * j + e];
          isum += scales_mins[pi] * s;
          msum += scales_mins[64 + pi] * bs[j];
        }
        const float d_act = a.d[i * blocks + b];
        acc = std::fmaf(static_cast<float>(isum), h8(dm, c) * d_act, acc);
        acc = std::fmaf(-static_cast<float>(msum), h8(dm + 16, c) * d_act, acc);
        break;
      }
      case GgmlType::Q6_K: {
        const uint8_t* sc = record(3, b);
        const int8_t* q = row.q(b, 256);
        const int16_t* bs = a.bs16 + (i * blocks + b) * 16;
        int32_t isum = 0, osum = 0;
        for (int j = 0; j < 16; ++j) {
          const int s8 = static_cast<int8_t>(sc[16 * (j / 2) + 2 * c + (j & 1)]);
          int32_t s = 0;
          for (int e = 16 * (j & 1); e < 16 * (j & 1) + 16; ++e)
            s += (nib(record(0, b) + 128 * (j / 2), c, e) | bits45(record(1, b) + 64 * (j / 2), c, e)) *
                 q[16 * j + e % 16];
          isum += s8 * s;
          osum += s8 * bs[j];
        }
        isum -= osum * 32;
        acc = std::fmaf(static_cast<float>(isum), h8(record(2, b), c) * a.d[i * blocks + b], acc);
        break;
      }
      default:
        break;
    }
  }
  return acc;
}

}  // namespace

void quantize_rows_scalar(Acts& a, const float* x, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) quantize_row(a, x + r * a.K, r, quantize_block);
}

void run_scalar(const Job& job, int64_t t0, int64_t t1) {
  const Packed& w = *job.w;
  for (int64_t g = t0; g < t1; ++g)
    for (int c = 0; c < kGroup && g * kGroup + c < w.rows; ++c)
      for (int64_t i = 0; i < job.a->m; ++i) job.y[i * job.ldy + g * kGroup + c] = dot_row(w, g, c, Row{*job.a, i});
}

}  // namespace specchat::detail
