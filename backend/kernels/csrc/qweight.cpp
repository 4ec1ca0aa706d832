// The binding: QWeight registered as a TorchScript class, the free ops, and at::parallel_for installed as the
// kernels' thread pool (torch's thread count at each call). The only qgemm source that includes torch headers.
#include "qweight.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <stdexcept>
#include <string>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "torch runs its threads through OpenMP: build the qgemm sources with -fopenmp, or at::parallel_for runs serially"
#endif

namespace specchat {
namespace {

void torch_parallel_for(int64_t n, void* ctx, ParallelBody body) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { body(ctx, begin, end); });
}

const bool installed = [] {
  set_parallel_for(torch_parallel_for);
  return true;
}();

template <class F>
auto checked(F&& f) -> decltype(f()) {  // std::invalid_argument → ValueError, other kernel errors → RuntimeError
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::out_of_range& e) {
    TORCH_CHECK_INDEX(false, e.what());
  }
}

std::string kernel_isa() { return isa_name(active_isa()); }

std::string kernel_isa_for_rows(int64_t m) { return isa_name(isa_for_rows(m)); }

std::string kernel_set_isa(const std::string& name) {
  Isa wanted;
  if (name == "auto") return isa_name(reset_isa());
  if (name == "scalar")
    wanted = Isa::Scalar;
  else if (name == "avx2")
    wanted = Isa::Avx2;
  else if (name == "avx512")
    wanted = Isa::Avx512;
  else
    TORCH_CHECK_VALUE(false, "kernel_set_isa: '", name, "' is not one of auto, scalar, avx2, avx512");
  return isa_name(set_active_isa(wanted));
}

}  // namespace

QWeight::QWeight(const at::Tensor& data, int64_t ggml_type, int64_t rows, int64_t cols) {
  (void)installed;
  TORCH_CHECK_VALUE(data.scalar_type() == at::kByte && data.device().is_cpu(),
                    "QWeight: data must be a uint8 CPU tensor of GGUF blocks, got ", data.scalar_type(), " on ",
                    data.device());
  TORCH_CHECK_VALUE(ggml_type >= 0 && ggml_type < 64 && is_supported(static_cast<int32_t>(ggml_type)),
                    "QWeight: ggml type ", ggml_type,
                    " is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  const at::Tensor bytes = data.contiguous();
  m_ = checked([&] {
    return QMatrix::from_blocks(static_cast<GgmlType>(ggml_type), rows, cols, bytes.const_data_ptr<uint8_t>(),
                                static_cast<size_t>(bytes.numel()));
  });
}

at::Tensor QWeight::matmul(const at::Tensor& x) const {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "QWeight.matmul: x must be a 2-D float32 CPU tensor [M, ", m_.cols(), "], got ", x.sizes(), " ",
                    x.scalar_type(), " on ", x.device());
  TORCH_CHECK_VALUE(x.size(1) == m_.cols(), "QWeight.matmul: x has ", x.size(1), " columns, the weight ", m_.cols(),
                    " inputs");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), m_.rows()}, x.options());
  checked(
      [&] { specchat::matmul(m_, xc.const_data_ptr<float>(), xc.size(0), y.mutable_data_ptr<float>(), m_.rows()); });
  return y;
}

double QWeight::time_matmul(const at::Tensor& x, int64_t repeats) const {
  TORCH_CHECK_VALUE(repeats > 0, "QWeight.time_matmul: repeats must be positive, got ", repeats);
  at::Tensor y = matmul(x);  // checks x, warms the caches and the thread pool
  const at::Tensor xc = x.contiguous();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < repeats; ++i)
    specchat::matmul(m_, xc.const_data_ptr<float>(), xc.size(0), y.mutable_data_ptr<float>(), m_.rows());
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return took.count() / static_cast<double>(repeats);
}

at::Tensor QWeight::dequantize() const {
  at::Tensor out = at::empty({m_.rows(), m_.cols()}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, m_.rows(), 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) m_.dequantize_row(n, o + n * m_.cols());
  });
  return out;
}

at::Tensor QWeight::rows_of(const at::Tensor& ids) const {
  TORCH_CHECK_VALUE(ids.dim() == 1 && !at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                    "QWeight.rows_of: ids must be a 1-D integer tensor, got ", ids.sizes(), " ", ids.scalar_type());
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t* p = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < m_.rows(), "QWeight.rows_of: id ", p[i], " is outside [0, ", m_.rows(), ")");
  at::Tensor out = at::empty({idx.numel(), m_.cols()}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < idx.numel(); ++i) m_.dequantize_row(p[i], o + i * m_.cols());
  return out;
}

TORCH_LIBRARY_FRAGMENT(specchat, m) {
  m.class_<QWeight>("QWeight")
      .def(torch::init<const at::Tensor&, int64_t, int64_t, int64_t>())
      .def("matmul", &QWeight::matmul)
      .def("dequantize", &QWeight::dequantize)
      .def("rows_of", &QWeight::rows_of)
      .def("time_matmul", &QWeight::time_matmul)
      .def("nbytes", &QWeight::nbytes)
      .def("ggml_type", &QWeight::ggml_type)
      .def("rows", &QWeight::rows)
      .def("cols", &QWeight::cols);
  m.def("kernel_isa() -> str", &kernel_isa);
  m.def("kernel_set_isa(str name) -> str", &kernel_set_isa);
  m.def("kernel_isa_for_rows(int m) -> str", &kernel_isa_for_rows);
}

}  // namespace specchat
