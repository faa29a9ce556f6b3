// Batched fp32 products C_i (= or +=) A_i B_i on the small GEMM of _native_gemm.h, for the chunk
// products of FLASH's mixed-chunk attention (ops/flash.py).
//
// Why this file exists: PyTorch's CPU fp32 bmm is MKL's, which takes its AVX2 code path on AMD
// CPUs. On the Zen 5 machine of docs/benchmarks.md (fifteenth round) it ran FLASH's chunk
// products (16 chunks of 256 x 256 x 1024, 128 x 256 x 1024, ...) at 135-207 GFLOP/s; the
// register-blocked AVX-512 kernel the fused attention kernels use runs them at 420-490, with A
// read through any strides (a transposed A costs no copy) and C written in place.
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts (strides in elements): A_i(m, k) = a[i * a_bs + m * ars + k * acs]; B_i row-major with
// row stride ldb, batch stride bbs; C_i row-major with row stride ldc, batch stride cbs.
// Each element of C is summed over k in order by one thread (a product may be split into bands
// of rows over threads when there are fewer products than threads), so the result does not
// depend on the thread count.

#include "_native_common.h"
#include "_native_gemm.h"

extern "C" {

int tn_bmm_ready() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;  // AVX2 (or plain loops): MKL's AVX2 bmm is PyTorch's, as fast a path on such a CPU
#endif
}

int tn_bmm_f32(const float* a, idx a_bs, idx ars, idx acs, const float* b, idx bbs, idx ldb, float* c, idx cbs,
               idx ldc, idx nb, idx M, idx N, idx K, int accumulate, int nthreads) {
    using namespace tn;
    if (nb < 0 || M < 0 || N < 0 || K < 0) return 1;
    // work items: (product, band of rows); a few products get split into bands so that every
    // thread has work, each band a multiple of the micro-kernel's rows
    const idx bands = std::max<idx>(1, std::min<idx>((nthreads + nb - 1) / std::max<idx>(nb, 1),
                                                     (M + kMR - 1) / kMR));
    parallel_ranges(nb * bands, nthreads, [&](idx t0, idx t1) {
        for (idx t = t0; t < t1; ++t) {
            const idx i = t / bands, band = t % bands;
            const idx blocks = (M + kMR - 1) / kMR;
            const idx m0 = std::min(M, blocks * band / bands * kMR), m1 = std::min(M, blocks * (band + 1) / bands * kMR);
            if (m1 <= m0) continue;
            gemm<float>(m1 - m0, N, K, a + i * a_bs + m0 * ars, ars, acs, b + i * bbs, ldb, c + i * cbs + m0 * ldc,
                        ldc, accumulate != 0);
        }
    });
    return 0;
}

}  // extern "C"
