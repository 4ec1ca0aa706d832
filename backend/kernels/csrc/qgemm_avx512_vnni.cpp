// The AVX-512 path with VNNI (Cascade Lake, Ice Lake and later, Zen 4 and later): qgemm_avx512.h's traits.
#include "qgemm_layout.h"

#define SC_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define SC_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) inline

#include "qgemm_avx512.h"
#include "qgemm_simd.h"

namespace specchat::detail {

void run_avx512_vnni(const Job& job, int64_t t0, int64_t t1) { Kern<Avx512<true>>::run(job, t0, t1); }

}  // namespace specchat::detail
