// Weight kernels that compute straight on a GGUF file's blocks (issue 31): y = x · Wᵀ for a weight W [N outputs,
// K inputs] held in its GGUF block type, for 1 row (decoding) up to hundreds (verification, prefill chunks).
//
// How: the weight is repacked once at load into groups of 8 output columns whose codes interleave so that one
// 32-byte vector holds 4 consecutive inputs of each of the 8 columns (qgemm_layout.h); activations are quantised
// to 8 bits once per pass (blocks of 32 with their sums for Q4_0..Q8_0, blocks of 256 with 16- and 32-sums for
// the K-quants); each block's dot product is integer (AVX2 maddubs/madd, AVX-512 VNNI dpbusd), exact, and a
// tile of up to 4 activation rows shares every unpacked weight block. Float weights (F32/F16/BF16) take float
// activations and FMA.
//
// Rows never change a row's result: y[i, n] is the same sequence of float operations whatever the number of
// rows, the tile the row falls in, the thread count and the column split: each (row, column) has its own float
// accumulator (a vector lane), updated once per block in block order by the same instructions in every tile
// shape; the integer sums are exact. The scalar path performs the same float operations (fmaf), so every ISA
// gives the same bits (tests/backend/kernels/test_blocks.py checks all of this).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace specchat {

enum class GgmlType : int32_t {  // ggml's ids
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
};

enum class Isa : int32_t { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// The path matmul takes: chosen once at first use, the best this CPU supports (AVX2 needs AVX2+FMA+F16C; AVX-512
// needs F+BW+VL+DQ and uses VNNI where present), lowered by the environment variable SPECCHAT_KERNELS=scalar|avx2|
// avx512 (never raised above the CPU's; "auto" or another value keeps the CPU's choice, the latter with one line on
// stderr).
Isa active_isa();
// The path a call of m activation rows takes: active_isa(), except that where it is the CPU's own choice of AVX-512
// (no SPECCHAT_KERNELS, no set_active_isa), calls of up to four rows run AVX2, faster there (qgemm_dispatch.cpp).
// The paths give the same bits, so a row's result does not depend on it.
Isa isa_for_rows(int64_t m);
// "avx512-vnni", "avx512", "avx2", "scalar" (Avx512 is named by what this CPU has).
const char* isa_name(Isa isa);
// Tests and benchmarks: switch the path at run time (clamped to what the CPU supports); returns the path now active.
Isa set_active_isa(Isa wanted);
// Back to the CPU's own choice, narrow calls on AVX2 included; returns active_isa().
Isa reset_isa();

// Whether `ggml_type` is one of GgmlType's values; its name ("Q4_K"; "?" if not); elements and bytes per GGUF block.
bool is_supported(int32_t ggml_type);
const char* type_name(GgmlType t);
int64_t block_elems(GgmlType t);
size_t block_bytes(GgmlType t);

// How matmul spreads work over threads: body(ctx, begin, end) must be called over disjoint ranges covering
// [0, n). The torch binding installs at::parallel_for (torch's current thread count at call time); without a hook
// the work runs on the calling thread. The result does not depend on how the range is split.
using ParallelBody = void (*)(void* ctx, int64_t begin, int64_t end);
using ParallelFor = void (*)(int64_t n, void* ctx, ParallelBody body);
void set_parallel_for(ParallelFor fn);

namespace detail {
struct FreeDeleter {
  void operator()(uint8_t* p) const;
};
// The repacked weight (qgemm_layout.h documents the planes): output columns in groups of 8 (the last group padded
// with zero columns), up to 4 planes each holding one record per (group, block), groups one after another.
struct Packed {
  GgmlType type = GgmlType::F32;
  int64_t rows = 0, cols = 0;  // N outputs, K inputs
  int64_t groups = 0;          // ceil(rows / 8)
  int64_t blocks = 0;          // blocks per row: cols / block_elems
  int plane_count = 0;
  const uint8_t* plane[4] = {nullptr, nullptr, nullptr, nullptr};
  size_t record_bytes[4] = {0, 0, 0, 0};  // bytes per (group, block) record of each plane
  // the record of (group g, block b) in plane p: plane[p] + (g * blocks + b) * record_bytes[p]
};
}  // namespace detail

class QMatrix {  // a weight [rows = N outputs, cols = K inputs] in its GGUF block type, repacked
 public:
  // Validates the type and sizes (std::invalid_argument naming the value) and repacks `data` (the tensor's GGUF
  // bytes, rows × cols/block_elems blocks) into one aligned copy; the caller may drop `data` afterwards.
  static QMatrix from_blocks(GgmlType t, int64_t rows, int64_t cols, const uint8_t* data, size_t nbytes);

  QMatrix() = default;
  QMatrix(QMatrix&&) noexcept = default;
  QMatrix& operator=(QMatrix&&) noexcept = default;
  QMatrix(const QMatrix&) = delete;
  QMatrix& operator=(const QMatrix&) = delete;

  int64_t rows() const { return p_.rows; }
  int64_t cols() const { return p_.cols; }
  GgmlType type() const { return p_.type; }
  size_t nbytes() const { return bytes_; }  // bytes held in memory (the repacked copy)

  // Row n of W as float32 [cols], exactly as ggml de-quantises it (embedding lookups, tests).
  void dequantize_row(int64_t n, float* out) const;

  const detail::Packed& packed() const { return p_; }

 private:
  detail::Packed p_;
  std::unique_ptr<uint8_t, detail::FreeDeleter> data_;
  size_t bytes_ = 0;
};

// y [m, N] (row stride ldy >= N) = x [m, K] (float32, row-major, contiguous) · Wᵀ. Threads over output columns.
void matmul(const QMatrix& w, const float* x, int64_t m, float* y, int64_t ldy);

// Several weights reading the same input (q/k/v, gate/up): the activations are quantised once per format.
// Every weight must have the same cols; ys[i] has row stride ldys[i].
void matmul_many(const std::vector<const QMatrix*>& ws, const float* x, int64_t m, const std::vector<float*>& ys,
                 const std::vector<int64_t>& ldys);

}  // namespace specchat
