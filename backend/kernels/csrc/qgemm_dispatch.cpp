// The one dispatch point: which ISA runs (cpuid, SPECCHAT_KERNELS), the activations quantised once per format,
// the column tiles of every weight of a call spread over threads through the installed parallel_for.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "qgemm.h"
#include "qgemm_layout.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define SC_X86 1
#endif

namespace specchat {
namespace {

struct Cpu {
  Isa best = Isa::Scalar;
  bool vnni = false;
};

#ifdef SC_X86
// The feature bits read below (Intel SDM vol. 2A, CPUID; XCR0 from xgetbv): leaf 1 ECX, leaf 7 sub-leaf 0 EBX/ECX.
constexpr unsigned kLeaf1EcxFma = 1u << 12;
constexpr unsigned kLeaf1EcxOsxsave = 1u << 27;  // the OS uses xsave, so xgetbv may be read
constexpr unsigned kLeaf1EcxAvx = 1u << 28;
constexpr unsigned kLeaf1EcxF16c = 1u << 29;
constexpr unsigned kLeaf7EbxAvx2 = 1u << 5;
constexpr unsigned kLeaf7EbxAvx512F = 1u << 16;
constexpr unsigned kLeaf7EbxAvx512Dq = 1u << 17;
constexpr unsigned kLeaf7EbxAvx512Bw = 1u << 30;
constexpr unsigned kLeaf7EbxAvx512Vl = 1u << 31;
constexpr unsigned kLeaf7EcxAvx512Vnni = 1u << 11;
constexpr unsigned kXcr0Ymm = 0x6;   // the OS saves SSE and AVX state (XMM, YMM upper halves)
constexpr unsigned kXcr0Zmm = 0xe6;  // ... and AVX-512's (opmask, ZMM upper halves, ZMM16-31)
#endif

Cpu detect() {
  Cpu cpu;
#ifdef SC_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return cpu;
  const bool fma = c & kLeaf1EcxFma, osxsave = c & kLeaf1EcxOsxsave, avx = c & kLeaf1EcxAvx, f16c = c & kLeaf1EcxF16c;
  if (!(osxsave && avx)) return cpu;
  unsigned xlo = 0, xhi = 0;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_state = (xlo & kXcr0Ymm) == kXcr0Ymm, zmm_state = (xlo & kXcr0Zmm) == kXcr0Zmm;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return cpu;
  const bool avx2 = b & kLeaf7EbxAvx2;
  const bool f512 = b & kLeaf7EbxAvx512F, dq = b & kLeaf7EbxAvx512Dq, bw = b & kLeaf7EbxAvx512Bw,
             vl = b & kLeaf7EbxAvx512Vl;
  if (ymm_state && avx2 && fma && f16c) cpu.best = Isa::Avx2;
  if (cpu.best == Isa::Avx2 && zmm_state && f512 && dq && bw && vl) {
    cpu.best = Isa::Avx512;
    cpu.vnni = c & kLeaf7EcxAvx512Vnni;
  }
#endif
  return cpu;
}

const Cpu& cpu() {
  static const Cpu found = detect();
  return found;
}

Isa clamp(Isa wanted) { return static_cast<int32_t>(wanted) < static_cast<int32_t>(cpu().best) ? wanted : cpu().best; }

// Whether the path is the CPU's own choice (no SPECCHAT_KERNELS, no set_active_isa since reset_isa): only then
// do narrow calls leave AVX-512 for AVX2 (isa_for_rows).
std::atomic<bool> g_auto{true};

Isa from_env() {
  const char* v = std::getenv("SPECCHAT_KERNELS");
  if (!v || !*v || !std::strcmp(v, "auto")) return cpu().best;
  Isa chosen;
  if (!std::strcmp(v, "scalar"))
    chosen = Isa::Scalar;
  else if (!std::strcmp(v, "avx2"))
    chosen = clamp(Isa::Avx2);
  else if (!std::strcmp(v, "avx512"))
    chosen = clamp(Isa::Avx512);
  else {
    std::fprintf(stderr, "specchat: SPECCHAT_KERNELS=%s is not one of auto, scalar, avx2, avx512; using %s\n", v,
                 isa_name(cpu().best));
    return cpu().best;
  }
  g_auto.store(false);
  return chosen;
}

// Calls of at most this many activation rows run the AVX2 path where the CPU's choice is AVX-512: on a Zen 4 the
// AVX2 path is the faster up to four rows, level at five and behind from eight, the gap showing when the weights
// stream from memory, for a cause not established (benchmarks/RESULTS.md, "AVX2 for calls of up to four rows on an
// AVX-512 CPU"). Both paths give the same bits: speed only.
constexpr int64_t kNarrowRows = 4;

std::atomic<int> g_isa{-1};
std::atomic<ParallelFor> g_parallel{nullptr};

// Scratch for the quantised activations, per calling thread (a pass quantises once, then the threads read it).
struct Scratch {
  std::vector<uint8_t> bytes;
  void* take(size_t& off, size_t n) {
    void* p = bytes.data() + off;
    off += (n + 63) / 64 * 64;
    return p;
  }
};

size_t act_bytes(detail::ActFormat f, int64_t m, int64_t K) {
  const size_t n = static_cast<size_t>(m), k = static_cast<size_t>(K), r = 64 * 6;  // 6 arrays' alignment
  if (f == detail::ActFormat::Q8_32) return n * k + n * (k / 32) * 12 + r;
  return n * k + n * (k / 256) * 4 + n * (k / 16) * 2 + n * (k / 32) * 2 + r;
}

struct QuantCtx {
  detail::Acts* a;
  const float* x;
  bool vec;
};

void quant_body(void* ctx, int64_t r0, int64_t r1) {
  const QuantCtx& q = *static_cast<const QuantCtx*>(ctx);
  if (q.vec)
    detail::quantize_rows_avx2(*q.a, q.x, r0, r1);
  else
    detail::quantize_rows_scalar(*q.a, q.x, r0, r1);
}

struct RunCtx {
  std::vector<detail::Job> jobs;
  std::vector<int64_t> first;  // first tile of each job in the joint range; first.back() = all tiles
  Isa isa;
};

void run_body(void* ctx, int64_t t0, int64_t t1) {
  const RunCtx& rc = *static_cast<const RunCtx*>(ctx);
  for (size_t j = 0; j < rc.jobs.size(); ++j) {
    const int64_t lo = std::max(t0, rc.first[j]), hi = std::min(t1, rc.first[j + 1]);
    if (lo >= hi) continue;
    const int64_t a = lo - rc.first[j], b = hi - rc.first[j];
    switch (rc.isa) {
      case Isa::Avx512:
        detail::run_avx512(rc.jobs[j], a, b, cpu().vnni);
        break;
      case Isa::Avx2:
        detail::run_avx2(rc.jobs[j], a, b);
        break;
      default:
        detail::run_scalar(rc.jobs[j], a, b);
        break;
    }
  }
}

}  // namespace

void run_parallel(int64_t n, void* ctx, ParallelBody body) {
  if (n <= 0) return;
  const ParallelFor hook = g_parallel.load();
  if (hook && n > 1)
    hook(n, ctx, body);
  else
    body(ctx, 0, n);
}

Isa active_isa() {
  int v = g_isa.load();
  if (v < 0) {
    static std::once_flag once;
    std::call_once(once, [] {
      int expected = -1;
      g_isa.compare_exchange_strong(expected, static_cast<int>(from_env()));
    });
    v = g_isa.load();
  }
  return static_cast<Isa>(v);
}

Isa set_active_isa(Isa wanted) {
  active_isa();  // the environment's choice is made first, so it never overrides this one later
  g_auto.store(false);
  g_isa.store(static_cast<int>(clamp(wanted)));
  return active_isa();
}

Isa reset_isa() {
  active_isa();
  g_isa.store(static_cast<int>(cpu().best));
  g_auto.store(true);
  return active_isa();
}

Isa isa_for_rows(int64_t m) {
  const Isa isa = active_isa();
  return isa == Isa::Avx512 && m <= kNarrowRows && g_auto.load() ? Isa::Avx2 : isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512:
      return cpu().vnni ? "avx512-vnni" : "avx512";
    case Isa::Avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

void set_parallel_for(ParallelFor fn) { g_parallel.store(fn); }

void matmul(const QMatrix& w, const float* x, int64_t m, float* y, int64_t ldy) { matmul_many({&w}, x, m, {y}, {ldy}); }

void matmul_many(const std::vector<const QMatrix*>& ws, const float* x, int64_t m, const std::vector<float*>& ys,
                 const std::vector<int64_t>& ldys) {
  using detail::ActFormat;
  if (ws.size() != ys.size() || ws.size() != ldys.size())
    throw std::invalid_argument("matmul_many: " + std::to_string(ws.size()) + " weights, " + std::to_string(ys.size()) +
                                " outputs and " + std::to_string(ldys.size()) + " strides");
  if (m < 0) throw std::invalid_argument("matmul: " + std::to_string(m) + " rows");
  if (ws.empty() || m == 0) return;
  const int64_t K = ws[0]->cols();
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!ws[i] || ws[i]->rows() == 0) throw std::invalid_argument("matmul: an empty weight");
    if (ws[i]->cols() != K)
      throw std::invalid_argument("matmul_many: weights of " + std::to_string(ws[i]->cols()) + " and " +
                                  std::to_string(K) + " inputs read the same x");
    if (!ys[i] || ldys[i] < ws[i]->rows())
      throw std::invalid_argument("matmul: output row stride " + std::to_string(ldys[i]) + " < " +
                                  std::to_string(ws[i]->rows()) + " outputs");
  }
  if (!x) throw std::invalid_argument("matmul: no input");

  const Isa isa = isa_for_rows(m);
  thread_local Scratch scratch;
  detail::Acts acts[3];  // by ActFormat
  bool ready[3] = {false, false, false};
  size_t need = 0;
  for (const QMatrix* w : ws) {
    const ActFormat f = detail::act_format(w->type());
    if (f != ActFormat::F32 && !ready[static_cast<int>(f)]) {
      need += act_bytes(f, m, K);
      ready[static_cast<int>(f)] = true;
    }
  }
  if (scratch.bytes.size() < need) scratch.bytes.resize(need);
  size_t off = 0;
  for (int f = 0; f < 3; ++f) {
    detail::Acts& a = acts[f];
    a.fmt = static_cast<ActFormat>(f);
    a.m = m;
    a.K = K;
    a.x = x;
    if (!ready[f]) continue;
    a.qs = static_cast<int8_t*>(scratch.take(off, static_cast<size_t>(m * K)));
    const int64_t nd = m * K / (a.fmt == ActFormat::Q8_32 ? 32 : 256);
    a.d = static_cast<float*>(scratch.take(off, nd * sizeof(float)));
    if (a.fmt == ActFormat::Q8_32) {
      a.sum = static_cast<int32_t*>(scratch.take(off, nd * sizeof(int32_t)));
      a.s = static_cast<float*>(scratch.take(off, nd * sizeof(float)));
    } else {
      a.bs16 = static_cast<int16_t*>(scratch.take(off, m * K / 16 * sizeof(int16_t)));
      a.bs32 = static_cast<int16_t*>(scratch.take(off, m * K / 32 * sizeof(int16_t)));
    }
    QuantCtx qc{&a, x, isa != Isa::Scalar};
    if (m >= 8)
      run_parallel(m, &qc, quant_body);
    else
      quant_body(&qc, 0, m);
  }

  RunCtx rc;
  rc.isa = isa;
  rc.first.push_back(0);
  for (size_t i = 0; i < ws.size(); ++i) {
    const detail::Packed& p = ws[i]->packed();
    rc.jobs.push_back({&p, &acts[static_cast<int>(detail::act_format(p.type))], ys[i], ldys[i]});
    const int64_t tiles = isa == Isa::Avx512 ? (p.groups + 1) / 2 : p.groups;
    rc.first.push_back(rc.first.back() + tiles);
  }
  run_parallel(rc.first.back(), &rc, run_body);
}

}  // namespace specchat
