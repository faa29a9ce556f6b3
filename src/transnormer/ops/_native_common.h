// Shared by the fused CPU kernels: bfloat16 storage and scalar conversions (the arithmetic is
// fp32), and the split of rows (or heads) over threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
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
    // round to nearest even, as PyTorch's float -> bfloat16 conversion; a NaN stays a quiet NaN
    // (the rounding add could carry its payload into the exponent). A select, not a branch, so
    // that loops storing bf16 vectorize.
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
    dst->bits = uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

// exp(x) for x <= 0 without a library call, so loops over a row vectorize: x = n ln2 + r,
// degree-7 Taylor polynomial of e^r (relative error < 1e-7), 2^n through the exponent bits, in two
// factors so that results below 2^-126 come out subnormal, not clamped (silu(-88) had been 2.7x
// off, silu(-1e4) -1.6e-34 instead of 0).
// expm1_nonpositive: e^x - 1 without the cancellation of subtracting 1 when n = 0 (|x| < ln2/2):
// r times the polynomial without its leading 1 (elu(-1e-7) had been -1.19e-7).
struct ExpParts {
    float n, r, q;  // e^x = 2^n (1 + r q)
};

inline ExpParts exp_parts(float x) {
    // e^-104 < 2^-149: 0 after the scaling. (Not std::max: it returns a reference, which GCC
    // turns into a branch that keeps the loops calling this from vectorizing.)
    x = x < -104.0f ? -104.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float q = 1.0f / 5040.0f;
    q = q * r + 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    q = q * r + 1.0f;
    return {n, r, q};
}

inline float pow2_nonpositive(float n) {  // 2^n for integral n in [-150, 0]
    const int32_t n1 = int32_t(n) >> 1, n2 = int32_t(n) - n1;  // each >= -75: a normal float
    const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    float s1, s2;
    std::memcpy(&s1, &b1, 4);
    std::memcpy(&s2, &b2, 4);
    return s1 * s2;
}

inline float exp_nonpositive(float x) {
    const ExpParts e = exp_parts(x);
    return (e.r * e.q + 1.0f) * pow2_nonpositive(e.n);
}

inline float expm1_nonpositive(float x) {
    const ExpParts e = exp_parts(x);
    const float rq = e.r * e.q;
    return e.n == 0.0f ? rq : (rq + 1.0f) * pow2_nonpositive(e.n) - 1.0f;
}

// sigmoid through exp(-|a|) <= 1 (no overflow), branch-free so row loops vectorize
inline float sigmoid(float a) {
    const float e = exp_nonpositive(-std::fabs(a));
    const float r = 1.0f / (1.0f + e);
    return a >= 0.0f ? r : e * r;
}

// f(std::true_type{}) if flag, else f(std::false_type{}): inside f the flag is a constant, so a loop
// that tests it (an optional bias, say) compiles to two loops without a branch, which vectorize.
template <typename F>
inline void with_flag(bool flag, F f) {
    if (flag) f(std::true_type{});
    else f(std::false_type{});
}

// std::vector storage on 64-byte (cache-line) boundaries. The kernels' scratch buffers need it:
// malloc aligns to 16 bytes only (a large block lands 16 bytes past a page), so every row of an
// AMX tile load and every 64-byte vector load split across two cache lines. Aligned, the
// softmax kernel's 64 x 64 x 64 tile product ran 1.5x faster (8.4 against 12.3 ns a TDPBF16PS).
template <class T>
struct CacheAligned {
    using value_type = T;
    CacheAligned() = default;
    template <class U>
    CacheAligned(const CacheAligned<U>&) {}
    T* allocate(size_t n) {
        void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
        if (!p) throw std::bad_alloc();
        return static_cast<T*>(p);
    }
    void deallocate(T* p, size_t) { std::free(p); }
    template <class U>
    bool operator==(const CacheAligned<U>&) const { return true; }
    template <class U>
    bool operator!=(const CacheAligned<U>&) const { return false; }
};
template <class T>
using buffer = std::vector<T, CacheAligned<T>>;

// Rows to fetch into L2 while a product runs (the next tiles of a walk over chunks): the GEMMs
// (_native_gemm.h, _native_amx.h) ask for a share of them before each block of C, so the misses
// overlap the arithmetic rather than stalling it in one burst. Up to two tiles of `rows` rows
// (row stride `ld` bytes, `bytes` per row).
struct RowPrefetch {
    const char* base[2] = {nullptr, nullptr};
    long ld[2] = {0, 0}, bytes[2] = {0, 0};
    int tiles = 0;
    long rows = 0, next = 0;
    void add(const void* p, long ld_bytes, long row_bytes, long nrows) {
        if (tiles == 2) return;  // full: the rest is left to the hardware
        base[tiles] = static_cast<const char*>(p), ld[tiles] = ld_bytes, bytes[tiles] = row_bytes;
        ++tiles, rows = nrows;
    }
    // the rows [next, upto)
    void issue(long upto) {
        for (; next < upto; ++next)
            for (int t = 0; t < tiles; ++t)
                for (long b = 0; b < bytes[t]; b += 64) __builtin_prefetch(base[t] + next * ld[t] + b, 0, 2);
    }
    // the share of the rows due after `done` of `total` steps of the product
    void share(long done, long total) { issue(rows * done / total); }
};

// The step after (head n, chunk g) of a walk over heads [lo, hi) within each chunk, the chunks
// in order (or in reverse): false after the last of the G chunks.
inline bool next_step(long& n, long& g, long lo, long hi, long G, bool reverse) {
    if (++n == hi) n = lo, g += reverse ? -1 : 1;
    return g >= 0 && g < G;
}

#if !defined(_OPENMP)
// work(t) for t in [0, nt), t = 0 on the calling thread, the others on threads of their own (a
// range that gets no thread, std::system_error, runs on the calling one)
template <typename W>
void run_on_threads(int nt, W work) {
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) {
        try {
            pool.emplace_back(work, t);
        } catch (...) {
            work(t);
        }
    }
    work(0);
    for (auto& th : pool) th.join();
}
#endif

// body(lo, hi) on [0, N) split into contiguous ranges, one per thread (the caller's thread too).
// Built with -fopenmp the threads come from the OpenMP runtime already in the process: with the
// PyPI CPU wheels that is PyTorch's bundled libgomp.so.1 (same soname, so this library binds to
// it), and PyTorch's workers, which spin for a while after each of its parallel ops, pick the
// work up instead of competing for the cores with threads of our own. (A PyTorch built with
// another OpenMP runtime would get a second pool: slower, not wrong.)
//
// An exception (std::bad_alloc from a scratch buffer) must not unwind out of an OpenMP region or
// through ctypes: either ends the process. Each range catches it and records it for this call;
// the kernel's other ranges run on, and the error is left to the calling thread (call_error()),
// which Python reads after every call on that thread (tn_take_error, _native.py's _call) and
// raises, discarding the outputs. Per calling thread: kernels run from two Python threads at once
// must not take each other's errors.

inline int& call_error() {
    thread_local int error = 0;  // 1: out of memory, 2: another exception
    return error;
}

template <typename F>
inline void guarded(std::atomic<int>& error, F&& f) {
    try {
        f();
    } catch (const std::bad_alloc&) {
        error.store(1);
    } catch (...) {
        error.store(2);
    }
}

template <typename F>
void parallel_ranges(long N, int nthreads, F body) {
    const int nt = (int)std::max<long>(1, std::min<long>(nthreads, N));
    std::atomic<int> error{0};
    if (nt == 1) {
        guarded(error, [&] { body(0, N); });
    } else {
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt)
        {
            const long t = omp_get_thread_num(), n = omp_get_num_threads();
            guarded(error, [&] { body(N * t / n, N * (t + 1) / n); });
        }
#else
        run_on_threads(nt, [&](int t) { guarded(error, [&] { body(N * t / nt, N * (t + 1) / nt); }); });
#endif
    }
    if (error.load()) call_error() = error.load();
}


// body(p, r0, r1) for each of `parts` fixed row ranges [N p / parts, N (p + 1) / parts), the parts
// spread over the threads: a kernel that sums a parameter's gradient over rows keeps one partial
// sum per part, so its result does not depend on the thread count
template <typename F>
void parallel_row_parts(long N, long parts, int nthreads, F body) {
    parallel_ranges(parts, nthreads, [&](long p0, long p1) {
        for (long p = p0; p < p1; ++p) body(p, N * p / parts, N * (p + 1) / parts);
    });
}

}  // namespace tn
