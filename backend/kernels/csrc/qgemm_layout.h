// Internal to the qgemm sources: the repacked weight layout, the quantised activations and the per-ISA entries.
//
// Columns (W's rows, the outputs) go in groups of 8. A "slice" is 32 bytes: 4 consecutive inputs of each of the 8
// columns, byte 4c+e = input 4s+e of column c, so a vector op multiplies one broadcast 4-byte run of an
// activation row with 8 columns at once and its 32-bit lane c is column c's partial sum: no horizontal sums,
// and every lane (one output) sees the same operations whatever else the vector holds. Per (group, block)
// record of each plane, a block being the type's GGUF block (32 or 256 inputs; one input for float types):
//
//   F32 / F16 / BF16  P0: the 8 columns' values of one input (32 / 16 / 16 bytes)
//   Q4_0  P0 qs 128   P1 d 16                      qs: 4 vectors k; byte 4c+e = code(c, 4k+e) | code(c, 16+4k+e) << 4
//   Q4_1  P0 qs 128   P1 dm 32 (d[8], then m[8])       (low nibbles: slices 0..3, high nibbles: slices 4..7)
//   Q5_0  P0 qs 128   P1 qh 32   P2 d 16           qh: byte 4c+e, bit s = bit 4 of code(c, 4s+e)
//   Q5_1  P0 qs 128   P1 qh 32   P2 dm 32
//   Q8_0  P0 qs 256 (8 slices of int8 codes)   P1 d 16
//   Q4_K  P0 qs 1024 (8 sub-blocks of 32 as Q4_0's)   P1 dm 32   P2 scales_mins 128: scale pairs [4][8 cols][2], then
//         min pairs [4][8][2] (6-bit; pair p = sub-blocks 2p, 2p+1)
//   Q5_K  P0 qs 1024   P1 qh 256 (8 × Q5_0's)   P2 dm 32   P3 scales_mins 128
//   Q6_K  P0 ql 1024 (low 4 bits, as Q4_K's qs)   P1 qh 512: per sub-block of 32, 2 vectors h; byte 4c+e bits
//         2t..2t+1 = bits 4..5 of code(c, 4(4h+t)+e)   P2 d 16   P3 sc 128: int8 scale pairs [8][8 cols][2]
//         (pair p = sub-blocks of 16 2p, 2p+1)
//
// Codes are unsigned (Q4_0 and Q5_0 subtract 8 and 16, Q6_K 32, through the activation sums) except Q8_0's.
// d / m / dmin are the file's fp16 values, 8 per record (column c at c). Padding columns are all zero.
#pragma once

#include <cstdint>
#include <cstring>

#include "qgemm.h"

namespace specchat::detail {

constexpr int kGroup = 8;  // columns per group

inline float half_to_float(uint16_t h) {  // exact, as F16C's vcvtph2ps
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float h8(const uint8_t* record, int c) { return half_to_float(load_u16(record + 2 * c)); }

// Codes of column c in one 32-input sub-block record (i: input 0..31).
inline int nib(const uint8_t* qs, int c, int i) {
  const int s = i >> 2, e = i & 3;
  const uint8_t byte = qs[32 * (s & 3) + 4 * c + e];
  return s >= 4 ? byte >> 4 : byte & 15;
}
inline int bit4(const uint8_t* qh, int c, int i) { return ((qh[4 * c + (i & 3)] >> (i >> 2)) & 1) << 4; }
inline int bits45(const uint8_t* qh, int c, int i) {
  const int s = i >> 2;
  return ((qh[32 * (s >> 2) + 4 * c + (i & 3)] >> (2 * (s & 3))) & 3) << 4;
}
inline int sbyte(const uint8_t* qs, int c, int i) { return static_cast<int8_t>(qs[32 * (i >> 2) + 4 * c + (i & 3)]); }

enum class ActFormat { F32, Q8_32, Q8_256 };

inline ActFormat act_format(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return ActFormat::F32;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return ActFormat::Q8_256;
    default:
      return ActFormat::Q8_32;
  }
}

// Activations x [m, K] as the kernels read them. Q8_32: per 32 inputs, int8 codes q = round(x / d) with
// d = max|x| / 127, their sum, and s = d * sum. Q8_256: per 256 inputs d, and the codes' sums per 16 and per 32.
struct Acts {
  ActFormat fmt = ActFormat::F32;
  int64_t m = 0, K = 0;
  const float* x = nullptr;  // F32: the input itself, row stride K
  int8_t* qs = nullptr;      // [m][K]
  float* d = nullptr;        // [m][K/32] or [m][K/256]
  int32_t* sum = nullptr;    // Q8_32 [m][K/32]
  float* s = nullptr;        // Q8_32 [m][K/32]
  int16_t* bs16 = nullptr;   // Q8_256 [m][K/16]
  int16_t* bs32 = nullptr;   // Q8_256 [m][K/32]
};

// Row `row` of x (K floats) into a, fmt Q8_32 or Q8_256: codes and d per block from block(x, n, q, &d) (each
// path's quantize_block: n = 32 or 256, the same bits on every path), then the integer sums the kernels read.
template <class Block>
inline void quantize_row(Acts& a, const float* x, int64_t row, Block&& block) {
  const int64_t K = a.K;
  int8_t* q = a.qs + row * K;
  if (a.fmt == ActFormat::Q8_32) {
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = row * blocks + b;
      block(x + b * 32, 32, q + b * 32, &a.d[i]);
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += q[b * 32 + j];
      a.sum[i] = s;
      a.s[i] = a.d[i] * static_cast<float>(s);
    }
    return;
  }
  const int64_t blocks = K / 256;
  for (int64_t b = 0; b < blocks; ++b) {
    block(x + b * 256, 256, q + b * 256, &a.d[row * blocks + b]);
    int16_t* b16 = a.bs16 + (row * blocks + b) * 16;
    int16_t* b32 = a.bs32 + (row * blocks + b) * 8;
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int e = 0; e < 16; ++e) s += q[b * 256 + 16 * j + e];
      b16[j] = static_cast<int16_t>(s);
    }
    for (int j = 0; j < 8; ++j) b32[j] = static_cast<int16_t>(b16[2 * j] + b16[2 * j + 1]);
  }
}

struct Job {
  const Packed* w;
  const Acts* a;
  float* y;
  int64_t ldy;
};

constexpr int64_t kRowChunk = 64;  // rows whose activations stay in L2 while a thread sweeps its columns

// Rows [r0, r1) of x quantised into a (fmt Q8_32 or Q8_256); the same codes and scales on every ISA.
void quantize_rows_scalar(Acts& a, const float* x, int64_t r0, int64_t r1);
void quantize_rows_avx2(Acts& a, const float* x, int64_t r0, int64_t r1);

// Column tiles [t0, t1) of one job: scalar and AVX2 tiles are groups of 8 columns, AVX-512 tiles pairs of groups.
void run_scalar(const Job& job, int64_t t0, int64_t t1);
void run_avx2(const Job& job, int64_t t0, int64_t t1);
void run_avx512(const Job& job, int64_t t0, int64_t t1, bool vnni);

}  // namespace specchat::detail
