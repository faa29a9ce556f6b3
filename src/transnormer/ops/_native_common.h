// Shared by the fused CPU kernels: bfloat16 storage and scalar conversions (the arithmetic is
// fp32), and the split of rows (or heads) over threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

typedef long idx;  // sizes and strides (elements)

namespace tn {

struct bf16 {
    uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, bf16* dst) {
    // round to nearest even, as PyTorch's float -> bfloat16 conversion (the values are finite)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    dst->bits = uint16_t(u >> 16);
}

// body(lo, hi) on [0, N) split into contiguous ranges, one per thread (the caller's thread too).
// Built with -fopenmp the threads are those of the OpenMP runtime PyTorch already loaded (its
// bundled libgomp.so.1 has the same soname, so this library binds to it): PyTorch's workers,
// which spin for a while after each of its parallel ops, pick the work up instead of competing
// for the cores with threads of our own.
template <typename F>
void parallel_ranges(long N, int nthreads, F body) {
    const int nt = (int)std::max<long>(1, std::min<long>(nthreads, N));
    if (nt == 1) {
        body(0, N);
        return;
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt)
    {
        const long t = omp_get_thread_num(), n = omp_get_num_threads();
        body(N * t / n, N * (t + 1) / n);
    }
#else
    auto work = [&](int t) { body(N * t / nt, N * (t + 1) / nt); };
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto& th : pool) th.join();
#endif
}

}  // namespace tn
