// QMatrix: the GGUF blocks checked and repacked once into qgemm_layout.h's groups of 8 columns; de-quantisation
// of one row from that copy, with ggml's formulas (the same float operations as ggml-quants.c and gguf-py).
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "qgemm.h"
#include "qgemm_layout.h"

namespace specchat {
namespace {

struct TypeInfo {
  GgmlType type;
  const char* name;
  int64_t block_inputs;  // inputs per GGUF block
  size_t bytes;          // bytes per GGUF block
  int plane_count;
  size_t record_bytes[4];  // bytes per (group, block) record of each plane
};

constexpr TypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, 1, {32, 0, 0, 0}},
    {GgmlType::F16, "F16", 1, 2, 1, {16, 0, 0, 0}},
    {GgmlType::BF16, "BF16", 1, 2, 1, {16, 0, 0, 0}},
    {GgmlType::Q4_0, "Q4_0", 32, 18, 2, {128, 16, 0, 0}},
    {GgmlType::Q4_1, "Q4_1", 32, 20, 2, {128, 32, 0, 0}},
    {GgmlType::Q5_0, "Q5_0", 32, 22, 3, {128, 32, 16, 0}},
    {GgmlType::Q5_1, "Q5_1", 32, 24, 3, {128, 32, 32, 0}},
    {GgmlType::Q8_0, "Q8_0", 32, 34, 2, {256, 16, 0, 0}},
    {GgmlType::Q4_K, "Q4_K", 256, 144, 3, {1024, 32, 128, 0}},
    {GgmlType::Q5_K, "Q5_K", 256, 176, 4, {1024, 256, 32, 128}},
    {GgmlType::Q6_K, "Q6_K", 256, 210, 4, {1024, 512, 16, 128}},
};

const TypeInfo* find_type(int32_t id) {
  for (const TypeInfo& t : kTypes)
    if (static_cast<int32_t>(t.type) == id) return &t;
  return nullptr;
}

const TypeInfo& info(GgmlType t) {
  const TypeInfo* found = find_type(static_cast<int32_t>(t));
  if (!found) throw std::invalid_argument("ggml type " + std::to_string(static_cast<int32_t>(t)) + " is not supported");
  return *found;
}

// One GGUF block of one column, decoded: unsigned codes (Q8_0: int8 stored as bytes), fp16 scale bits, and the
// K-quants' sub-block scales (6-bit scale/min for Q4_K/Q5_K, int8 for Q6_K).
struct Decoded {
  uint8_t code[256];
  uint16_t d, m;
  uint8_t sc[16], mn[8];
};

void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {  // ggml's get_scale_min_k4
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

void decode(GgmlType t, const uint8_t* b, Decoded& o) {
  using detail::load_u16;
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: {
      const bool min = t == GgmlType::Q4_1;
      o.d = load_u16(b);
      o.m = min ? load_u16(b + 2) : 0;
      const uint8_t* qs = b + (min ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        o.code[j] = qs[j] & 15;
        o.code[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool min = t == GgmlType::Q5_1;
      o.d = load_u16(b);
      o.m = min ? load_u16(b + 2) : 0;
      uint32_t qh;
      std::memcpy(&qh, b + (min ? 4 : 2), 4);
      const uint8_t* qs = b + (min ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        o.code[j] = static_cast<uint8_t>((qs[j] & 15) | (((qh >> j) & 1) << 4));
        o.code[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
      }
      break;
    }
    case GgmlType::Q8_0:
      o.d = load_u16(b);
      std::memcpy(o.code, b + 2, 32);
      break;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      o.d = load_u16(b);
      o.m = load_u16(b + 2);
      for (int j = 0; j < 8; ++j) scale_min_k4(j, b + 4, &o.sc[j], &o.mn[j]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = qs[32 * i + l];
          const int h0 = five ? ((qh[l] >> (2 * i)) & 1) << 4 : 0, h1 = five ? ((qh[l] >> (2 * i + 1)) & 1) << 4 : 0;
          o.code[64 * i + l] = static_cast<uint8_t>((q & 15) | h0);
          o.code[64 * i + 32 + l] = static_cast<uint8_t>((q >> 4) | h1);
        }
      break;
    }
    case GgmlType::Q6_K: {
      std::memcpy(o.sc, b + 192, 16);
      o.d = load_u16(b + 208);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        uint8_t* y = o.code + 128 * n;
        for (int l = 0; l < 32; ++l) {
          y[l] = static_cast<uint8_t>((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4));
          y[l + 32] = static_cast<uint8_t>((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
          y[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
          y[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
      }
      break;
    }
    default:
      break;
  }
}

// Writers of one 32-input sub-block of the 8 columns (dec[c].code + off) into a record.
void put_q4(const Decoded* dec, int off, uint8_t* qs) {
  for (int k = 0; k < 4; ++k)
    for (int c = 0; c < 8; ++c)
      for (int e = 0; e < 4; ++e) {
        const uint8_t* code = dec[c].code + off;
        qs[32 * k + 4 * c + e] = static_cast<uint8_t>((code[4 * k + e] & 15) | ((code[16 + 4 * k + e] & 15) << 4));
      }
}
void put_qh1(const Decoded* dec, int off, uint8_t* qh) {  // bit 4 of each code
  for (int c = 0; c < 8; ++c)
    for (int e = 0; e < 4; ++e) {
      uint8_t byte = 0;
      for (int s = 0; s < 8; ++s) byte |= static_cast<uint8_t>(((dec[c].code[off + 4 * s + e] >> 4) & 1) << s);
      qh[4 * c + e] = byte;
    }
}
void put_qh2(const Decoded* dec, int off, uint8_t* qh) {  // bits 4..5 of each code
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 8; ++c)
      for (int e = 0; e < 4; ++e) {
        uint8_t byte = 0;
        for (int t = 0; t < 4; ++t)
          byte |= static_cast<uint8_t>(((dec[c].code[off + 4 * (4 * h + t) + e] >> 4) & 3) << (2 * t));
        qh[32 * h + 4 * c + e] = byte;
      }
}
void put_h8(const Decoded* dec, bool min, uint8_t* record) {
  for (int c = 0; c < 8; ++c) std::memcpy(record + 2 * c, min ? &dec[c].m : &dec[c].d, 2);
}
void put_pairs(const uint8_t (*vals)[16], int pairs, uint8_t* record) {  // [p][c][2] from per-column values
  for (int p = 0; p < pairs; ++p)
    for (int c = 0; c < 8; ++c) {
      record[16 * p + 2 * c] = vals[c][2 * p];
      record[16 * p + 2 * c + 1] = vals[c][2 * p + 1];
    }
}

// Record (g, b) of every plane from the GGUF bytes of the group's columns.
void pack_block(const TypeInfo& ti, const uint8_t* src, int64_t rows, int64_t blocks, int64_t g, int64_t b,
                uint8_t* const* record) {
  const GgmlType t = ti.type;
  if (ti.block_inputs == 1) {  // float types: one input of 8 columns
    for (int c = 0; c < 8; ++c) {
      const int64_t n = 8 * g + c;
      if (n < rows) std::memcpy(record[0] + c * ti.bytes, src + (n * blocks + b) * ti.bytes, ti.bytes);
    }
    return;
  }
  Decoded dec[8];
  std::memset(dec, 0, sizeof dec);
  for (int c = 0; c < 8; ++c) {
    const int64_t n = 8 * g + c;
    if (n < rows) decode(t, src + (n * blocks + b) * ti.bytes, dec[c]);
  }
  uint8_t pairs[8][16];
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
      put_q4(dec, 0, record[0]);
      put_h8(dec, false, record[1]);
      if (t == GgmlType::Q4_1) put_h8(dec, true, record[1] + 16);
      break;
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
      put_q4(dec, 0, record[0]);
      put_qh1(dec, 0, record[1]);
      put_h8(dec, false, record[2]);
      if (t == GgmlType::Q5_1) put_h8(dec, true, record[2] + 16);
      break;
    case GgmlType::Q8_0:
      for (int s = 0; s < 8; ++s)
        for (int c = 0; c < 8; ++c) std::memcpy(record[0] + 32 * s + 4 * c, dec[c].code + 4 * s, 4);
      put_h8(dec, false, record[1]);
      break;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = t == GgmlType::Q5_K;
      for (int j = 0; j < 8; ++j) {
        put_q4(dec, 32 * j, record[0] + 128 * j);
        if (five) put_qh1(dec, 32 * j, record[1] + 32 * j);
      }
      uint8_t* dm = record[five ? 2 : 1];
      uint8_t* scales_mins = record[five ? 3 : 2];
      put_h8(dec, false, dm);
      put_h8(dec, true, dm + 16);
      for (int c = 0; c < 8; ++c) std::memcpy(pairs[c], dec[c].sc, 8);
      put_pairs(pairs, 4, scales_mins);
      for (int c = 0; c < 8; ++c) std::memcpy(pairs[c], dec[c].mn, 8);
      put_pairs(pairs, 4, scales_mins + 64);
      break;
    }
    case GgmlType::Q6_K:
      for (int j = 0; j < 8; ++j) {
        put_q4(dec, 32 * j, record[0] + 128 * j);
        put_qh2(dec, 32 * j, record[1] + 64 * j);
      }
      put_h8(dec, false, record[2]);
      for (int c = 0; c < 8; ++c) std::memcpy(pairs[c], dec[c].sc, 16);
      put_pairs(pairs, 8, record[3]);
      break;
    default:
      break;
  }
}

struct PackCtx {
  const TypeInfo* ti;
  const uint8_t* src;
  detail::Packed* p;
  uint8_t* base[4];
};

void pack_groups(void* ctx, int64_t g0, int64_t g1) {
  const PackCtx& k = *static_cast<const PackCtx*>(ctx);
  const detail::Packed& p = *k.p;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t b = 0; b < p.blocks; ++b) {
      uint8_t* record[4];
      for (int i = 0; i < 4; ++i) record[i] = k.base[i] + (g * p.blocks + b) * p.record_bytes[i];
      pack_block(*k.ti, k.src, p.rows, p.blocks, g, b, record);
    }
}

}  // namespace

void run_parallel(int64_t n, void* ctx, ParallelBody body);  // qgemm_dispatch.cpp

void detail::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

bool is_supported(int32_t ggml_type) { return find_type(ggml_type) != nullptr; }
const char* type_name(GgmlType t) {
  const TypeInfo* found = find_type(static_cast<int32_t>(t));
  return found ? found->name : "?";
}
int64_t block_elems(GgmlType t) { return info(t).block_inputs; }
size_t block_bytes(GgmlType t) { return info(t).bytes; }

QMatrix QMatrix::from_blocks(GgmlType t, int64_t rows, int64_t cols, const uint8_t* data, size_t nbytes) {
  const TypeInfo* ti = find_type(static_cast<int32_t>(t));
  if (!ti)
    throw std::invalid_argument("ggml type " + std::to_string(static_cast<int32_t>(t)) +
                                " is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  const std::string what =
      std::string(ti->name) + " weight [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  if (rows <= 0 || cols <= 0 || rows > (int64_t{1} << 31) || cols > (int64_t{1} << 31))
    throw std::invalid_argument(what + ": rows and cols must be between 1 and 2^31");
  if (cols % ti->block_inputs != 0)
    throw std::invalid_argument(what + ": cols must be a multiple of the type's block of " +
                                std::to_string(ti->block_inputs));
  const size_t need = static_cast<size_t>(rows) * static_cast<size_t>(cols / ti->block_inputs) * ti->bytes;
  if (nbytes != need)
    throw std::invalid_argument(what + ": the data holds " + std::to_string(nbytes) + " bytes, the shape needs " +
                                std::to_string(need));
  if (!data) throw std::invalid_argument(what + ": no data");

  QMatrix q;
  detail::Packed& p = q.p_;
  p.type = t;
  p.rows = rows;
  p.cols = cols;
  p.groups = (rows + detail::kGroup - 1) / detail::kGroup;
  p.blocks = cols / ti->block_inputs;
  p.plane_count = ti->plane_count;
  size_t offset[4] = {0, 0, 0, 0}, total = 0;
  for (int i = 0; i < 4; ++i) {
    p.record_bytes[i] = ti->record_bytes[i];
    offset[i] = total;
    total += (static_cast<size_t>(p.groups) * p.blocks * p.record_bytes[i] + 63) / 64 * 64;  // planes 64-byte aligned
  }
  uint8_t* mem = static_cast<uint8_t*>(std::aligned_alloc(64, total + 64));
  if (!mem) throw std::bad_alloc();
  q.data_.reset(mem);
  q.bytes_ = total;
  std::memset(mem, 0, total);  // padding columns stay zero
  PackCtx ctx{ti, data, &p, {}};
  for (int i = 0; i < 4; ++i) {
    ctx.base[i] = mem + offset[i];
    p.plane[i] = mem + offset[i];
  }
  run_parallel(p.groups, &ctx, pack_groups);
  return q;
}

void QMatrix::dequantize_row(int64_t n, float* out) const {
  using namespace detail;
  if (n < 0 || n >= p_.rows) throw std::out_of_range("row " + std::to_string(n) + " of " + std::to_string(p_.rows));
  const int64_t g = n / kGroup;
  const int c = static_cast<int>(n % kGroup);
  const GgmlType t = p_.type;
  for (int64_t b = 0; b < p_.blocks; ++b) {
    const uint8_t* r[4];
    for (int i = 0; i < 4; ++i) r[i] = p_.plane[i] + (g * p_.blocks + b) * p_.record_bytes[i];
    float* y = out + b * block_elems(t);
    switch (t) {
      case GgmlType::F32:
        std::memcpy(y, r[0] + 4 * c, 4);
        break;
      case GgmlType::F16:
        y[0] = half_to_float(load_u16(r[0] + 2 * c));
        break;
      case GgmlType::BF16:
        y[0] = bf16_to_float(load_u16(r[0] + 2 * c));
        break;
      case GgmlType::Q4_0:
        for (int i = 0; i < 32; ++i) y[i] = h8(r[1], c) * static_cast<float>(nib(r[0], c, i) - 8);
        break;
      case GgmlType::Q4_1:
        for (int i = 0; i < 32; ++i) y[i] = h8(r[1], c) * static_cast<float>(nib(r[0], c, i)) + h8(r[1] + 16, c);
        break;
      case GgmlType::Q5_0:
        for (int i = 0; i < 32; ++i) y[i] = h8(r[2], c) * static_cast<float>((nib(r[0], c, i) | bit4(r[1], c, i)) - 16);
        break;
      case GgmlType::Q5_1:
        for (int i = 0; i < 32; ++i)
          y[i] = h8(r[2], c) * static_cast<float>(nib(r[0], c, i) | bit4(r[1], c, i)) + h8(r[2] + 16, c);
        break;
      case GgmlType::Q8_0:
        for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(sbyte(r[0], c, i)) * h8(r[1], c);
        break;
      case GgmlType::Q4_K:
      case GgmlType::Q5_K: {
        const bool five = t == GgmlType::Q5_K;
        const uint8_t* dm = r[five ? 2 : 1];
        const uint8_t* scales_mins = r[five ? 3 : 2];
        for (int j = 0; j < 8; ++j) {
          const int pi = 16 * (j / 2) + 2 * c + (j & 1);
          const float d = h8(dm, c) * static_cast<float>(scales_mins[pi]);
          const float m = h8(dm + 16, c) * static_cast<float>(scales_mins[64 + pi]);
          for (int i = 0; i < 32; ++i) {
            const int code = nib(r[0] + 128 * j, c, i) | (five ? bit4(r[1] + 32 * j, c, i) : 0);
            y[32 * j + i] = d * static_cast<float>(code) - m;
          }
        }
        break;
      }
      case GgmlType::Q6_K:
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 32; ++i) {
            const int8_t sc = static_cast<int8_t>(r[3][16 * j + 2 * c + i / 16]);
            const int code = nib(r[0] + 128 * j, c, i) | bits45(r[1] + 64 * j, c, i);
            y[32 * j + i] = h8(r[2], c) * static_cast<float>(sc) * static_cast<float>(code - 32);
          }
        break;
    }
  }
}

}  // namespace specchat
