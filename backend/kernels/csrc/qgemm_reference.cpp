// STAND-IN for the weight kernels (qgemm.h): a plain reference implementation of the contract, so the native
// model builds and is tested before the real kernels land. Every matrix row is de-quantised from its ggml
// blocks (the formats of llama.cpp's ggml-quants.c) and multiplied in float32; nothing here is fast. The real
// kernels replace this file (and qgemm.h) whole; nothing else includes anything from it.
#include "qgemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>

namespace specchat {
namespace {

struct BlockShape {
  int64_t weights = 0, bytes = 0;
};

BlockShape block_shape(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return {1, 4};
    case GgmlType::F16: return {1, 2};
    case GgmlType::BF16: return {1, 2};
    case GgmlType::Q4_0: return {32, 18};
    case GgmlType::Q4_1: return {32, 20};
    case GgmlType::Q5_0: return {32, 22};
    case GgmlType::Q5_1: return {32, 24};
    case GgmlType::Q8_0: return {32, 34};
    case GgmlType::Q4_K: return {256, 144};
    case GgmlType::Q5_K: return {256, 176};
    case GgmlType::Q6_K: return {256, 210};
  }
  return {0, 0};
}

float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of ``type`` at ``b`` into y (its block_shape().weights values).
void dequantize_block(GgmlType type, const uint8_t* b, float* y) {
  switch (type) {
    case GgmlType::F32: std::memcpy(y, b, 4); return;
    case GgmlType::F16: y[0] = half(b); return;
    case GgmlType::BF16: {
      uint16_t bits;
      std::memcpy(&bits, b, 2);
      y[0] = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
      return;
    }
    case GgmlType::Q4_0: {
      const float d = half(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>((b[2 + j] & 0xF) - 8) * d;
        y[j + 16] = static_cast<float>((b[2 + j] >> 4) - 8) * d;
      }
      return;
    }
    case GgmlType::Q4_1: {
      const float d = half(b), m = half(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>(b[4 + j] & 0xF) * d + m;
        y[j + 16] = static_cast<float>(b[4 + j] >> 4) * d + m;
      }
      return;
    }
    case GgmlType::Q5_0:
    case GgmlType::Q5_1: {
      const bool one = type == GgmlType::Q5_1;
      const float d = half(b), m = one ? half(b + 2) : 0.0f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10);
        const int x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = one ? static_cast<float>(x0) * d + m : static_cast<float>(x0 - 16) * d;
        y[j + 16] = one ? static_cast<float>(x1) * d + m : static_cast<float>(x1 - 16) * d;
      }
      return;
    }
    case GgmlType::Q8_0: {
      const float d = half(b);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      return;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const bool five = type == GgmlType::Q5_K;
      const float d = half(b), dmin = half(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* q = b + (five ? 48 : 16);
      uint8_t sc, m, u1 = 1, u2 = 2;
      for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; ++l) {
          const int high = five && (qh[l] & u1) ? 16 : 0;
          *y++ = d1 * static_cast<float>((q[l] & 0xF) + high) - m1;
        }
        for (int l = 0; l < 32; ++l) {
          const int high = five && (qh[l] & u2) ? 16 : 0;
          *y++ = d2 * static_cast<float>((q[l] >> 4) + high) - m2;
        }
        q += 32;
        u1 = static_cast<uint8_t>(u1 << 2);
        u2 = static_cast<uint8_t>(u2 << 2);
      }
      return;
    }
    case GgmlType::Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half(b + 208);
      for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = d * sc[is] * static_cast<float>(q1);
          y[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
          y[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
          y[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
  }
}

// Σ a[k]·b[k] in 8 interleaved partial sums, then the partials in a fixed order: the same for every row.
float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int l = 0; l < 8; ++l) part[l] += a[k + l] * b[k + l];
  }
  for (int l = 0; k < n; ++k, ++l) part[l] += a[k] * b[k];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

}  // namespace

Isa active_isa() { return Isa::Scalar; }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Scalar: break;
  }
  return "scalar";
}

QMatrix QMatrix::from_blocks(GgmlType type, int64_t rows, int64_t cols, const uint8_t* data, size_t nbytes) {
  const BlockShape shape = block_shape(type);
  TORCH_CHECK(shape.weights > 0, "specchat: ggml type ", static_cast<int>(type), " has no kernel");
  TORCH_CHECK(rows > 0 && cols > 0 && cols % shape.weights == 0, "specchat: a ", rows, " x ", cols,
              " matrix is not whole blocks of ", shape.weights, " weights");
  const size_t row_bytes = static_cast<size_t>(cols / shape.weights * shape.bytes);
  TORCH_CHECK(nbytes == row_bytes * static_cast<size_t>(rows), "specchat: ", nbytes, " bytes for a ", rows, " x ",
              cols, " matrix of type ", static_cast<int>(type), " (expected ", row_bytes * rows, ")");
  QMatrix out;
  out.data_ = std::shared_ptr<uint8_t[]>(new uint8_t[nbytes]);
  std::memcpy(out.data_.get(), data, nbytes);
  out.rows_ = rows;
  out.cols_ = cols;
  out.type_ = type;
  out.nbytes_ = nbytes;
  out.row_bytes_ = row_bytes;
  return out;
}

void QMatrix::dequantize_row(int64_t n, float* out) const {
  TORCH_CHECK(n >= 0 && n < rows_, "specchat: row ", n, " of a matrix of ", rows_, " rows");
  const BlockShape shape = block_shape(type_);
  const uint8_t* row = data_.get() + static_cast<size_t>(n) * row_bytes_;
  for (int64_t b = 0; b < cols_ / shape.weights; ++b) dequantize_block(type_, row + b * shape.bytes, out + b * shape.weights);
}

void matmul(const QMatrix& w, const float* x, int64_t m, float* y, int64_t ldy) {
  const int64_t k = w.cols();
  at::parallel_for(0, w.rows(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t j = begin; j < end; ++j) {
      w.dequantize_row(j, row.data());
      for (int64_t i = 0; i < m; ++i) y[i * ldy + j] = dot(x + i * k, row.data(), k);
    }
  });
}

void matmul_many(const std::vector<const QMatrix*>& ws, const float* x, int64_t m, const std::vector<float*>& ys,
                 const std::vector<int64_t>& ldys) {
  TORCH_CHECK(ws.size() == ys.size() && ws.size() == ldys.size(), "specchat: matmul_many of ", ws.size(),
              " matrices into ", ys.size(), " outputs");
  for (size_t i = 0; i < ws.size(); ++i) matmul(*ws[i], x, m, ys[i], ldys[i]);
}

QWeight::QWeight(const at::Tensor& data, int64_t ggml_type, int64_t rows, int64_t cols) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte,
              "specchat.QWeight: the blocks must be a uint8 CPU tensor, got ", data.scalar_type());
  const at::Tensor bytes = data.contiguous();
  matrix_ = QMatrix::from_blocks(static_cast<GgmlType>(ggml_type), rows, cols, bytes.const_data_ptr<uint8_t>(),
                                 static_cast<size_t>(bytes.numel()));
}

at::Tensor QWeight::matmul(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == matrix_.cols(), "specchat.QWeight.matmul: x must be [m, ", matrix_.cols(),
              "], got ", x.sizes());
  const at::Tensor input = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), matrix_.rows()}, at::kFloat);
  specchat::matmul(matrix_, input.const_data_ptr<float>(), x.size(0), y.mutable_data_ptr<float>(), matrix_.rows());
  return y;
}

at::Tensor QWeight::dequantize() const {
  at::Tensor out = at::empty({matrix_.rows(), matrix_.cols()}, at::kFloat);
  float* o = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < matrix_.rows(); ++r) matrix_.dequantize_row(r, o + r * matrix_.cols());
  return out;
}

at::Tensor QWeight::rows_of(const at::Tensor& ids) const {
  const at::Tensor index = ids.to(at::kLong).contiguous().view({-1});
  at::Tensor out = at::empty({index.numel(), matrix_.cols()}, at::kFloat);
  const int64_t* id = index.const_data_ptr<int64_t>();
  float* o = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < index.numel(); ++i) matrix_.dequantize_row(id[i], o + i * matrix_.cols());
  return out;
}

}  // namespace specchat

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.class_<specchat::QWeight>("QWeight")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t>())
      .def("matmul", &specchat::QWeight::matmul)
      .def("dequantize", &specchat::QWeight::dequantize)
      .def("rows_of", &specchat::QWeight::rows_of);
}
