// Weight kernels over GGUF blocks: the contract between the native model (model*.cpp) and the kernels.
//
// A QMatrix holds one weight matrix [rows, cols] as the file stores it (ggml block types). matmul computes
// y[m, rows] = x[m, cols] · Wᵀ for float32 activations x (the kernels quantise x themselves where their integer
// dot products want it), threaded over the weight's rows, with every output row computed by the same
// arithmetic whatever m is: a row's result never depends on the other rows of its pass (bit for bit).
// matmul_many runs several matrices over the same x (q/k/v, gate/up), sharing the activations' preparation.
//
// QWeight is the TorchScript face of a QMatrix (torch.classes.specchat.QWeight(Tensor data_uint8, int
// ggml_type, int rows, int cols)), registered with TORCH_LIBRARY_FRAGMENT(specchat, m); C++ code reaches the
// matrix through matrix().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace specchat {

enum class GgmlType : int32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
enum class Isa : int32_t { Scalar = 0, Avx2 = 1, Avx512 = 2 };

Isa active_isa();            // the instruction set the kernels run with on this CPU
const char* isa_name(Isa);   // "scalar", "avx2", "avx512"

class QMatrix {
 public:
  QMatrix() = default;
  // A copy of ``nbytes`` bytes of blocks (rows × cols / block weights × block bytes); throws c10::Error naming
  // what does not fit (an unknown type, cols not a whole number of blocks, a byte count that does not match).
  static QMatrix from_blocks(GgmlType type, int64_t rows, int64_t cols, const uint8_t* data, size_t nbytes);
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  GgmlType type() const { return type_; }
  size_t nbytes() const { return nbytes_; }
  void dequantize_row(int64_t n, float* out) const;  // row n as cols() float32 values

 private:
  std::shared_ptr<uint8_t[]> data_;
  int64_t rows_ = 0, cols_ = 0;
  GgmlType type_ = GgmlType::F32;
  size_t nbytes_ = 0, row_bytes_ = 0;
};

// y[i * ldy + j] = Σ_k x[i * cols + k] · W[j, k] for i < m, j < w.rows().
void matmul(const QMatrix& w, const float* x, int64_t m, float* y, int64_t ldy);
void matmul_many(const std::vector<const QMatrix*>& ws, const float* x, int64_t m, const std::vector<float*>& ys,
                 const std::vector<int64_t>& ldys);

struct QWeight : torch::CustomClassHolder {
  QWeight(const at::Tensor& data, int64_t ggml_type, int64_t rows, int64_t cols);
  const QMatrix& matrix() const { return matrix_; }
  at::Tensor matmul(const at::Tensor& x) const;      // x [m, cols] float32 -> [m, rows] float32
  at::Tensor dequantize() const;                     // [rows, cols] float32
  at::Tensor rows_of(const at::Tensor& ids) const;   // ids [n] int64 -> [n, cols] float32 (embedding lookup)

 private:
  QMatrix matrix_;
};

}  // namespace specchat
