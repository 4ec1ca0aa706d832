// The AVX-512 path without VNNI (AVX-512 F/BW/VL/DQ + FMA + F16C; Skylake-SP): qgemm_avx512.h's traits, and the
// entry that picks the VNNI build (qgemm_avx512_vnni.cpp) where the CPU has it.
#include "qgemm_layout.h"

#define SC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define SC_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"), always_inline)) inline

#include "qgemm_avx512.h"
#include "qgemm_simd.h"

namespace specchat::detail {

void run_avx512_vnni(const Job& job, int64_t t0, int64_t t1);

void run_avx512(const Job& job, int64_t t0, int64_t t1, bool vnni) {
  if (vnni)
    run_avx512_vnni(job, t0, t1);
  else
    Kern<Avx512<false>>::run(job, t0, t1);
}

}  // namespace specchat::detail
