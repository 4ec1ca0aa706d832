// The torch face of a QMatrix: torch.classes.specchat.QWeight(Tensor data_uint8, int ggml_type, int rows, int cols)
// (registered in qweight.cpp). C++ callers holding one (the native forward) use matrix() and qgemm.h's matmul.
#pragma once

#include <torch/custom_class.h>

#include "qgemm.h"

namespace specchat {

struct QWeight : torch::CustomClassHolder {
  // data: the tensor's GGUF bytes (uint8, CPU, any shape holding rows × cols / block_elems blocks); copied.
  QWeight(const at::Tensor& data, int64_t ggml_type, int64_t rows, int64_t cols);

  const QMatrix& matrix() const { return m_; }

  at::Tensor matmul(const at::Tensor& x) const;     // x [M, K] float32 → [M, N] float32
  at::Tensor dequantize() const;                    // [N, K] float32
  at::Tensor rows_of(const at::Tensor& ids) const;  // ids [L] integer in [0, N) → [L, K] float32
  // Seconds per matmul(x), the mean of `repeats` calls back to back into one output (benchmarks: the kernel's
  // cost without the Python call around it).
  double time_matmul(const at::Tensor& x, int64_t repeats) const;
  int64_t nbytes() const { return static_cast<int64_t>(m_.nbytes()); }
  int64_t ggml_type() const { return static_cast<int64_t>(m_.type()); }
  int64_t rows() const { return m_.rows(); }
  int64_t cols() const { return m_.cols(); }

 private:
  QMatrix m_;
};

}  // namespace specchat
