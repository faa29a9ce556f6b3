// The walk the softmax-attention kernels share (_native_softmax_amx.cpp: bf16 on AMX tiles or
// AVX512-BF16; _native_softmax.cpp: fp32 on AVX-512 or AVX2): the call's shape, where a head's rows lie,
// which keys a block of queries sees (its windows, and j <= i when causal) as lane masks, the key
// steps and query blocks each walk visits, delta = rowsum(dO * O), and the split of heads over
// threads.
//
// Layouts: q, k [B, T, H, D], v [B, T, H, E] with token rows at strides ldq, ldk, ldv (the batch
// stride T times it); o, dO, dq, dk, dv contiguous [B, T, H, D|E]; stats [B, H, 2, T] (see
// store_stats). Keys of query i: all (w = 0) or those of i's window [floor(i/w) w, floor(i/w) w +
// w), and only j <= i when causal. Queries lie along the vector lanes (scores are computed transposed, keys x queries).
#pragma once

#include <algorithm>
#include <cmath>

#include "_native_common.h"
#include "_native_simd.h"

#if defined(TN_AVX512) || defined(TN_AVX2_FMA)
namespace tn_softmax {

using tn::Lanes;

constexpr idx kK = 64;  // keys per step of both walks
constexpr float kLog2e = 1.44269504088896341f;  // both kernels take exp(x) as 2^(x log2 e)

struct Shape {
    idx B, T, H, D, E, w;
    bool causal;
    float scale;
    idx ldq, ldk, ldv;
};

// The shape a kernel can tile: D and E multiples of de, the window a multiple of wm, scale > 0
// (the running max of raw scores is that of the scaled ones), token strides that hold a row.
inline bool shape_ok(const Shape& s, idx de, idx wm) {
    return s.B >= 1 && s.T >= 1 && s.H >= 1 && s.D >= de && s.E >= de && s.D % de == 0 && s.E % de == 0 &&
           s.w >= 0 && s.w % wm == 0 && s.scale > 0 && s.ldq >= s.H * s.D && s.ldk >= s.H * s.D &&
           s.ldv >= s.H * s.E;
}

// sum_e a[e] b[e] in fp32 over a row of E values stored as fp32 or bf16 (delta = rowsum(dO * O))
#if defined(TN_AVX512)
template <typename T>
inline float row_dot(const T* a, const T* b, idx E) {
    __m512 d = _mm512_setzero_ps();
    for (idx e = 0; e < E; e += 16) {
        const __mmask16 m = tn::tail_mask(E - e);
        d = _mm512_fmadd_ps(tn::load16(a + e, m), tn::load16(b + e, m), d);
    }
    return _mm512_reduce_add_ps(d);
}
#else  // AVX2: fp32 rows, E a multiple of 8 (the fp32 kernel's shapes)
inline float row_dot(const float* a, const float* b, idx E) {
    __m256 d = _mm256_setzero_ps();
    for (idx e = 0; e < E; e += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), d);
    alignas(32) float x[8];
    _mm256_store_ps(x, d);
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
#endif

struct Walk {
    const Shape& s;
    const idx T;

    explicit Walk(const Shape& s_) : s(s_), T(s_.T) {}

    // element offset of token t of head n = b H + h in a [B, T, H, width] tensor with row stride ld
    idx at(idx n, idx t, idx width, idx ld) const { return (n / s.H) * T * ld + t * ld + (n % s.H) * width; }
    idx block_of(idx i) const { return s.w ? i / s.w * s.w : 0; }
    idx block_end(idx i) const { return s.w ? std::min(T, i / s.w * s.w + s.w) : T; }

    // The query lanes of block i0 that see key j: those in j's window, and after j when causal.
    Lanes visible(idx i0, idx j) const {
        if (j >= T) return 0;
        return tn::lane_range((s.causal ? j : block_of(j)) - i0, block_end(j) - i0);
    }
    // Whether every query of block i0 (nq queries) sees every key of step j0 (no mask needed).
    bool all_visible(idx i0, idx nq, idx j0) const {
        const idx w0 = block_of(i0);
        const bool one_window =
            s.w == 0 || (block_of(j0) == w0 && block_of(j0 + kK - 1) == w0 && block_of(i0 + nq - 1) == w0);
        return one_window && j0 + kK <= T && i0 + nq <= T && (!s.causal || j0 + kK - 1 <= i0);
    }

    // Forward: the key steps [fwd_start, fwd_end) of query block i0 (nq queries, in one window);
    // keys of a step before the window are masked.
    idx fwd_start(idx i0) const { return block_of(i0) / kK * kK; }
    idx fwd_end(idx i0, idx nq) const {
        return s.causal ? std::min(block_end(i0), std::min(T, i0 + nq)) : block_end(i0);
    }
    // Backward: the query blocks (of nq) [bwd_start, bwd_end) that see key step j0; queries of a
    // block outside the step's windows are masked.
    idx bwd_start(idx j0, idx nq) const { return (s.causal ? j0 : block_of(j0)) / nq * nq; }
    idx bwd_end(idx j0) const { return block_end(std::min(j0 + kK, T) - 1); }

    // stats of head n, query t, written by the forward: the max m of the query's raw scores (q.k,
    // unscaled) at n 2T + t, log2 of its sum l = sum_j 2^((s_j - m) c) at n 2T + T + t (c = scale
    // log2 e), so that the backward's P = 2^((s - m) c - log2 l) takes its exponent from the
    // difference of two raw scores. A log-sum-exp would round to a multiple of its ulp, which for
    // |scale m| > 2^31 is more than the exponent range (P overflowed to inf, the gradients NaN).
    void store_stats(float* stats, idx n, idx t, float m, float l) const {
        stats[n * 2 * T + t] = m;
        stats[n * 2 * T + T + t] = std::log2(l);
    }
    // The backward's per-query rows of head n, rows [3 x Tp] (zero past T): m, log2 l, then
    // delta = rowsum(dO * O). o: [B, T, H, E] at row stride ldo; g: head n's dO rows, E apart.
    template <typename V>
    void query_rows(const float* stats, idx n, const V* o, idx ldo, const V* g, idx Tp, float* rows) const {
        std::fill(rows, rows + 3 * Tp, 0.0f);
        for (idx t = 0; t < T; ++t) {
            rows[t] = stats[n * 2 * T + t];
            rows[Tp + t] = stats[n * 2 * T + T + t];
            rows[2 * Tp + t] = row_dot(o + at(n, t, s.E, ldo), g + t * s.E, s.E);
        }
    }
};

// body(worker, n) for every head n = b H + h, the heads split over threads, one Worker(s,
// backward) per thread (its buffers reused across the thread's heads).
template <typename Worker, typename F>
void run_heads(const Shape& s, bool backward, int nthreads, F body) {
    tn::parallel_ranges(s.B * s.H, nthreads, [&](idx lo, idx hi) {
        Worker wk(s, backward);
        for (idx n = lo; n < hi; ++n) body(wk, n);
    });
}

}  // namespace tn_softmax
#endif  // TN_AVX512 || TN_AVX2_FMA
