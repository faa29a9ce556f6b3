// fp32 softmax attention on AVX-512 or AVX2 with FMA, forward and backward (the fp32 twin of
// _native_softmax_amx.cpp: same walk, same layouts, the products on the fp32 micro-kernel of
// _native_gemm.h instead of AMX tiles). One Worker walks for both ISAs; each has its own
// lane-wise passes (namespace lanes: the softmax of a step's scores, its gradient, the blocked
// transpose).
//
// Why this file exists: PyTorch's CPU SDPA kernel reaches about two thirds of the fp32 GEMM
// rate over forward + backward (its backward is the slower half), and the softmax baseline
// spends most of a long-sequence training step there.
//
// Layouts as in _native_softmax_amx.cpp: q, k [B, T, H, D], v [B, T, H, E] fp32 with token rows
// at strides ldq, ldk, ldv; o, dO, dq, dk, dv contiguous; stats [B, H, 2, T] (each query's raw
// score max and log2 of its sum, _native_softmax_walk.h). Keys of query i: all
// (w = 0) or those of i's window of w tokens (w a multiple of 64), only j <= i when causal.
//
// Numerics: all in fp32 (products accumulate in fp32; exp within 7e-8 relative, by the degree-7
// Taylor polynomial scaled by VSCALEFPS on AVX-512, the degree-6 minimax one times 2^n built in
// the exponent bits on AVX2, flushing below 2^-125). Scores are computed transposed (S^T = K Q^T,
// keys x 64 queries, queries along the vector lanes), so the softmax is lane-wise; P^T and dS^T
// then enter the products directly as strided operands (P = (P^T)^T), with no repacking.
// The walk: heads split over threads; per head the rows are packed zero-padded to a multiple
// of 64 (Q^T and dO^T in blocks of 64 queries, the B operands of the score products).
// Forward: groups of query blocks take each key step in turn (online softmax, O accumulated
// in fp32 rows). Backward: groups of key steps take each query block in turn (dK, dV
// accumulate per key step, dQ in an fp32 copy of the head).

#include "_native_common.h"
#include "_native_gemm.h"
#include "_native_simd.h"
#include "_native_softmax_walk.h"

#if defined(TN_AVX512) || defined(TN_AVX2_FMA)
#include <limits>

namespace {
using namespace tn_softmax;

constexpr idx kQ = 64;      // queries per block (the window granularity)
constexpr idx kGroupQ = 4;  // forward: query blocks that take each key step in turn
constexpr idx kGroupK = 4;  // backward: key steps that take each query block in turn

// The lane-wise passes over a step's S^T [kK x kQ] (keys x queries, ld kQ), in place. vis[r]:
// the query lanes that see key r, read only where !full (every lane sees every key).
//   softmax_step: P^T = 2^((S^T - m) c) on visible lanes, 0 elsewhere; the running max m and
//     sum l (kQ each) updated, alpha[kQ] the rescale of O's rows; returns whether any max rose.
//   grad_step: P^T as the forward left it (m, log2 l of each query) and dS^T = P (dP - delta)
//     scale in place of dP^T.
// Also per ISA: blocked_transpose (X^T per block of kQ rows); shared: scale_rows, write_rows.
namespace lanes {
#if defined(TN_AVX512)
using tn::half;
constexpr auto exp2_masked = tn::exp2_masked<7>;

inline bool softmax_step(float* st, float* m, float* l, float* alpha, bool full, const Lanes* vis, float cf) {
    const __m512 c = _mm512_set1_ps(cf);
    __m512 mx[4], sum[4], a[4];
    for (int h = 0; h < 4; ++h) mx[h] = _mm512_loadu_ps(m + 16 * h);
    for (idx r = 0; r < kK; ++r) {
        const Lanes v = full ? ~Lanes(0) : vis[r];
        for (int h = 0; h < 4; ++h)
            mx[h] = _mm512_mask_max_ps(mx[h], half(v, h), mx[h], _mm512_loadu_ps(st + r * kQ + 16 * h));
    }
    bool moved = false;
    for (int h = 0; h < 4; ++h) {  // a lane with no visible key yet keeps m = -inf: alpha 1, p 0
        __mmask16 rose;
        a[h] = tn::online_rescale(_mm512_loadu_ps(m + 16 * h), mx[h], c, rose);
        moved |= rose != 0;
        _mm512_storeu_ps(m + 16 * h, mx[h]);
        _mm512_storeu_ps(alpha + 16 * h, a[h]);
        sum[h] = _mm512_mul_ps(_mm512_loadu_ps(l + 16 * h), a[h]);
    }
    for (idx r = 0; r < kK; ++r) {
        const Lanes v = full ? ~Lanes(0) : vis[r];
        for (int h = 0; h < 4; ++h) {
            float* x = st + r * kQ + 16 * h;
            const __m512 p = exp2_masked(half(v, h), _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), mx[h]), c));
            _mm512_storeu_ps(x, p);
            sum[h] = _mm512_add_ps(sum[h], p);
        }
    }
    for (int h = 0; h < 4; ++h) _mm512_storeu_ps(l + 16 * h, sum[h]);
    return moved;
}

inline void grad_step(float* st, float* dpt, const float* mr, const float* ll, const float* dl, bool full,
                      const Lanes* vis, float cf, float scalef) {
    const __m512 c = _mm512_set1_ps(cf), scale = _mm512_set1_ps(scalef);
    __m512 m[4], lg[4], delta[4];
    for (int h = 0; h < 4; ++h) {
        m[h] = _mm512_loadu_ps(mr + 16 * h);
        lg[h] = _mm512_loadu_ps(ll + 16 * h);
        delta[h] = _mm512_loadu_ps(dl + 16 * h);
    }
    for (idx r = 0; r < kK; ++r) {
        const Lanes v = full ? ~Lanes(0) : vis[r];
        for (int h = 0; h < 4; ++h) {
            float* x = st + r * kQ + 16 * h;
            float* d = dpt + r * kQ + 16 * h;
            const __m512 e = _mm512_fmsub_ps(_mm512_sub_ps(_mm512_loadu_ps(x), m[h]), c, lg[h]);
            const __m512 p = exp2_masked(half(v, h), e);
            _mm512_storeu_ps(x, p);
            _mm512_storeu_ps(d, _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(d), delta[h])), scale));
        }
    }
}

// X^T per block of kQ rows: [R/kQ][C][kQ] from X [R x C] (C a multiple of 16)
inline void blocked_transpose(const float* x, idx R, idx C, float* dst) {
    for (idx b = 0; b < R; b += kQ)
        for (idx r0 = 0; r0 < kQ; r0 += 16)
            for (idx c0 = 0; c0 < C; c0 += 16) tn::transpose16(x + (b + r0) * C + c0, C, dst + b * C + c0 * kQ + r0, kQ);
}
#else
// AVX2, sixteen registers: one vector of eight queries at a time over the step's 64 keys (the
// AVX-512 passes hold four vectors of max, sum and rescale each; eight here would spill).
constexpr int kV = kQ / 8;  // vectors per block

inline __m256 lane_mask(bool full, const Lanes* vis, idx r, int h) {
    return full ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) : tn::lane_mask8(vis[r], h);
}

inline bool softmax_step(float* st, float* m, float* l, float* alpha, bool full, const Lanes* vis, float cf) {
    const __m256 c = _mm256_set1_ps(cf);
    bool moved = false;
    for (int h = 0; h < kV; ++h) {  // a lane with no visible key yet keeps m = -inf: alpha 1, p 0
        const __m256 m_old = _mm256_loadu_ps(m + 8 * h);
        __m256 mx = m_old;
        for (idx r = 0; r < kK; ++r)
            mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(st + r * kQ + 8 * h)), lane_mask(full, vis, r, h));
        bool rose;
        const __m256 a = tn::online_rescale8(m_old, mx, c, rose);
        moved |= rose;
        _mm256_storeu_ps(alpha + 8 * h, a);
        _mm256_storeu_ps(m + 8 * h, mx);
        __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(l + 8 * h), a);
        for (idx r = 0; r < kK; ++r) {
            float* x = st + r * kQ + 8 * h;
            const __m256 p = tn::exp2_8(lane_mask(full, vis, r, h), _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), mx), c));
            _mm256_storeu_ps(x, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(l + 8 * h, sum);
    }
    return moved;
}

inline void grad_step(float* st, float* dpt, const float* mr, const float* ll, const float* dl, bool full,
                      const Lanes* vis, float cf, float scalef) {
    const __m256 c = _mm256_set1_ps(cf), scale = _mm256_set1_ps(scalef);
    for (int h = 0; h < kV; ++h) {
        const __m256 m = _mm256_loadu_ps(mr + 8 * h), lg = _mm256_loadu_ps(ll + 8 * h);
        const __m256 delta = _mm256_loadu_ps(dl + 8 * h);
        for (idx r = 0; r < kK; ++r) {
            float* x = st + r * kQ + 8 * h;
            float* d = dpt + r * kQ + 8 * h;
            const __m256 e = _mm256_fmsub_ps(_mm256_sub_ps(_mm256_loadu_ps(x), m), c, lg);
            const __m256 p = tn::exp2_8(lane_mask(full, vis, r, h), e);
            _mm256_storeu_ps(x, p);
            _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(d), delta)), scale));
        }
    }
}

// X^T per block of kQ rows: [R/kQ][C][kQ] from X [R x C] (C a multiple of 8)
inline void blocked_transpose(const float* x, idx R, idx C, float* dst) {
    for (idx b = 0; b < R; b += kQ)
        for (idx r0 = 0; r0 < kQ; r0 += 8)
            for (idx c0 = 0; c0 < C; c0 += 8) {
                __m256 v[8];
                for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(x + (b + r0 + i) * C + c0);
                tn::transpose8(v);
                for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + b * C + (c0 + j) * kQ + r0, v[j]);
            }
}
#endif

// Both ISAs on _native_gemm.h's vectors (C a multiple of 16, so whole vectors):
// each row r of X [kQ x C] times f[r]
inline void scale_rows(float* x, idx C, const float* f) {
    typedef Vec<float> V;
    for (idx r = 0; r < kQ; ++r) {
        const V::reg a = V::bcast(f[r]);
        for (idx e = 0; e < C; e += V::W) V::store(x + r * C + e, V::mul(V::load(x + r * C + e), a));
    }
}
// rows of an fp32 [L x C] block (ld C) to out rows at stride ld_out, streamed where the rows are
// aligned to a vector
inline void write_rows(const float* x, idx L, idx C, float* out, idx ld_out) {
    typedef Vec<float> V;
    constexpr uintptr_t kAlign = V::W * sizeof(float) - 1;
    const bool aligned = ((reinterpret_cast<uintptr_t>(out) | uintptr_t(ld_out * 4)) & kAlign) == 0;
    for (idx r = 0; r < L; ++r)
        for (idx e = 0; e < C; e += V::W) {
            const V::reg y = V::load(x + r * C + e);
            if (aligned) V::stream(out + r * ld_out + e, y);
            else V::store(out + r * ld_out + e, y);
        }
}
}  // namespace lanes

struct Worker : Walk {
    const idx D, E, Tp;  // Tp: T rounded up to 64
    tn::buffer<float> qp, kp, vp, gp, qt, gt, st, dpt, acc, ml, dqf, dkv, rows;
    Lanes vis[kK];  // a masked step's visible query lanes per key

    Worker(const Shape& s_, bool backward)
        : Walk(s_), D(s_.D), E(s_.E), Tp((s_.T + kK - 1) / kK * kK), kp(Tp * D), vp(Tp * E), qt(Tp * D),
          st(kK * kQ) {
        if (backward) {
            qp.resize(Tp * D), gp.resize(Tp * E), gt.resize(Tp * E), dpt.resize(kK * kQ), dqf.resize(Tp * D);
            dkv.resize(kGroupK * kK * (D + E)), rows.resize(3 * Tp);
        } else {
            qp.resize(Tp * D), acc.resize(kGroupQ * kQ * E), ml.resize(2 * kGroupQ * kQ);
        }
    }
    ~Worker() { _mm_sfence(); }  // the streamed output rows

    // rows [0, T) of x (row stride ld, width C) into dst [Tp x C], zero rows below
    void pack(const float* x, idx ld, idx C, float* dst) const {
        for (idx t = 0; t < T; ++t) std::copy(x + t * ld, x + t * ld + C, dst + t * C);
        std::fill(dst + T * C, dst + Tp * C, 0.0f);
    }
    void load_qkv(const float* q, const float* k, const float* v, idx n) {
        pack(q + at(n, 0, D, s.ldq), s.ldq, D, qp.data());
        pack(k + at(n, 0, D, s.ldk), s.ldk, D, kp.data());
        pack(v + at(n, 0, E, s.ldv), s.ldv, E, vp.data());
        lanes::blocked_transpose(qp.data(), Tp, D, qt.data());
    }
    void scores(idx i0, idx j0) {  // S^T [kK x kQ] = K Q^T
        gemm<float>(kK, kQ, D, kp.data() + j0 * D, D, 1, qt.data() + i0 * D, kQ, st.data(), kQ, false);
    }
    // whether every query of block i0 sees every key of step j0; if not, vis[] filled
    bool mark_visible(idx i0, idx j0) {
        const bool full = all_visible(i0, kQ, j0);
        if (!full)
            for (idx r = 0; r < kK; ++r) vis[r] = visible(i0, j0 + r);
        return full;
    }

    // ---- forward -------------------------------------------------------------------------

    // One key step of query block i0: running max m and sum l (kQ floats each), O rows (acc).
    void fwd_step(idx i0, idx j0, float* m, float* l, float* acc) {
        scores(i0, j0);
        const bool full = mark_visible(i0, j0);
        alignas(64) float alpha[kQ];
        if (lanes::softmax_step(st.data(), m, l, alpha, full, vis, s.scale * kLog2e))
            lanes::scale_rows(acc, E, alpha);  // the max rose: rescale O
        // O += P V with P = (P^T)^T read strided
        gemm<float>(kQ, E, kK, st.data(), 1, kQ, vp.data() + j0 * E, E, acc, E, true);
    }

    void forward(const float* q, const float* k, const float* v, float* o, float* stats, idx n) {
        load_qkv(q, k, v, n);
        for (idx g0 = 0; g0 < T; g0 += kQ * kGroupQ) {
            const idx nb = std::min(kGroupQ, (T - g0 + kQ - 1) / kQ);
            std::fill(ml.begin(), ml.begin() + kGroupQ * kQ, -std::numeric_limits<float>::infinity());
            std::fill(ml.begin() + kGroupQ * kQ, ml.end(), 0.0f);
            std::fill(acc.begin(), acc.end(), 0.0f);
            const idx last = g0 + (nb - 1) * kQ;
            for (idx j0 = fwd_start(g0); j0 < fwd_end(last, kQ); j0 += kK)
                for (idx b = 0; b < nb; ++b) {
                    const idx i0 = g0 + b * kQ;
                    if (j0 >= fwd_start(i0) && j0 < fwd_end(i0, kQ))
                        fwd_step(i0, j0, ml.data() + b * kQ, ml.data() + (kGroupQ + b) * kQ, acc.data() + b * kQ * E);
                }
            for (idx b = 0; b < nb; ++b) {  // O /= l; the stats m, log2 l
                const idx i0 = g0 + b * kQ, L = std::min(kQ, T - i0);
                const float* m = ml.data() + b * kQ;
                const float* l = ml.data() + (kGroupQ + b) * kQ;
                float inv[kQ];
                for (idx r = 0; r < kQ; ++r) inv[r] = 1.0f / l[r];
                lanes::scale_rows(acc.data() + b * kQ * E, E, inv);
                for (idx r = 0; r < L; ++r) store_stats(stats, n, i0 + r, m[r], l[r]);
                lanes::write_rows(acc.data() + b * kQ * E, L, E, o + at(n, i0, E, s.H * E), s.H * E);
            }
        }
    }

    // ---- backward ------------------------------------------------------------------------

    // Key step j0 with query block i0 (its m, log2 l and delta: rows at i0, Tp + i0, 2 Tp + i0).
    void bwd_step(idx i0, idx j0, float* dkb, float* dvb) {
        scores(i0, j0);
        gemm<float>(kK, kQ, E, vp.data() + j0 * E, E, 1, gt.data() + i0 * E, kQ, dpt.data(), kQ, false);  // dP^T
        const bool full = mark_visible(i0, j0);
        const float* r = rows.data() + i0;
        lanes::grad_step(st.data(), dpt.data(), r, r + Tp, r + 2 * Tp, full, vis, s.scale * kLog2e, s.scale);
        gemm<float>(kK, E, kQ, st.data(), kQ, 1, gp.data() + i0 * E, E, dvb, E, true);   // dV += P^T dO
        gemm<float>(kK, D, kQ, dpt.data(), kQ, 1, qp.data() + i0 * D, D, dkb, D, true);  // dK += dS^T Q
        gemm<float>(kQ, D, kK, dpt.data(), 1, kQ, kp.data() + j0 * D, D, dqf.data() + i0 * D, D, true);  // dQ += dS K
    }

    void backward(const float* q, const float* k, const float* v, const float* o, const float* dout, const float* stats,
                  float* dq, float* dk, float* dv, idx n) {
        load_qkv(q, k, v, n);
        const idx ldo = s.H * E;
        pack(dout + at(n, 0, E, ldo), ldo, E, gp.data());
        lanes::blocked_transpose(gp.data(), Tp, E, gt.data());  // dO^T per query block: dP^T = V dO^T
        query_rows(stats, n, o, ldo, gp.data(), Tp, rows.data());  // per query: m, log2 l, delta
        std::fill(dqf.begin(), dqf.end(), 0.0f);
        for (idx g0 = 0; g0 < T; g0 += kK * kGroupK) {
            const idx nk = std::min(kGroupK, (T - g0 + kK - 1) / kK);
            std::fill(dkv.begin(), dkv.end(), 0.0f);
            const idx last = g0 + (nk - 1) * kK;
            for (idx i0 = bwd_start(g0, kQ); i0 < bwd_end(last); i0 += kQ)
                for (idx c = 0; c < nk; ++c) {
                    const idx j0 = g0 + c * kK;
                    if (i0 >= bwd_start(j0, kQ) && i0 < bwd_end(j0))
                        bwd_step(i0, j0, dkv.data() + c * kK * D, dkv.data() + (kGroupK * D + c * E) * kK);
                }
            for (idx c = 0; c < nk; ++c) {
                const idx j0 = g0 + c * kK, L = std::min(kK, T - j0);
                lanes::write_rows(dkv.data() + c * kK * D, L, D, dk + at(n, j0, D, s.H * D), s.H * D);
                lanes::write_rows(dkv.data() + (kGroupK * D + c * E) * kK, L, E, dv + at(n, j0, E, s.H * E), s.H * E);
            }
        }
        lanes::write_rows(dqf.data(), T, D, dq + at(n, 0, D, s.H * D), s.H * D);
    }
};

}  // namespace
#endif  // TN_AVX512 || TN_AVX2_FMA

extern "C" {

// 1 when this build has the fp32 softmax kernel (AVX-512, or AVX2 with FMA), else 0.
int tn_softmax_f32_ready() {
#if defined(TN_AVX512) || defined(TN_AVX2_FMA)
    return 1;
#else
    return 0;
#endif
}

// Test hook: the two exp2 forms of _native_simd.h on n values, every lane kept (degree 5 or 7),
// so that a test can hold exp2_bits to exp2_masked bit for bit. 2 without AVX-512.
int tn_exp2_pair_f32(const float* x, float* masked, float* bits, idx n, int degree, int) {
#if defined(TN_AVX512)
    if (degree != 5 && degree != 7) return 1;
    for (idx i = 0; i < n; i += 16) {
        const __mmask16 k = tn::tail_mask(n - i);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        const __m512 a = degree == 5 ? tn::exp2_masked<5>(0xFFFF, v) : tn::exp2_masked<7>(0xFFFF, v);
        const __m512 b = degree == 5 ? tn::exp2_bits<5>(0xFFFF, v) : tn::exp2_bits<7>(0xFFFF, v);
        _mm512_mask_storeu_ps(masked + i, k, a);
        _mm512_mask_storeu_ps(bits + i, k, b);
    }
    return 0;
#else
    (void)x, (void)masked, (void)bits, (void)n, (void)degree;
    return 2;
#endif
}

// Test hook: the exp2 of this build's fp32 kernel (AVX-512: exp2_masked<7>; AVX2: exp2_8) on
// n values, lane i kept where keep[i] != 0 (0 elsewhere). 2 without the kernel.
int tn_exp2_kernel_f32(const float* x, const uint8_t* keep, float* out, idx n, int) {
#if defined(TN_AVX512)
    for (idx i = 0; i < n; i += 16) {
        const __mmask16 k = tn::tail_mask(n - i);
        __mmask16 kept = 0;
        for (idx j = 0; j < 16 && i + j < n; ++j) kept |= __mmask16(keep[i + j] != 0) << j;
        _mm512_mask_storeu_ps(out + i, k, tn::exp2_masked<7>(kept, _mm512_maskz_loadu_ps(k, x + i)));
    }
    return 0;
#elif defined(TN_AVX2_FMA)
    for (idx i = 0; i < n; i += 8) {
        alignas(32) float xs[8] = {}, ys[8];
        Lanes kept = 0;
        for (idx j = 0; j < 8 && i + j < n; ++j) xs[j] = x[i + j], kept |= Lanes(keep[i + j] != 0) << j;
        _mm256_store_ps(ys, tn::exp2_8(tn::lane_mask8(kept, 0), _mm256_load_ps(xs)));
        std::copy(ys, ys + std::min<idx>(8, n - i), out + i);
    }
    return 0;
#else
    (void)x, (void)keep, (void)out, (void)n;
    return 2;
#endif
}

// Status: 0 ok, 1 bad shape (D, E multiples of 16, w of 64, scale > 0), 2 built without AVX-512
// or AVX2 with FMA.
#if defined(TN_AVX512) || defined(TN_AVX2_FMA)
#define TN_SOFTMAX_F32_RUN(BWD, CALL)                                                                  \
    const Shape s{B, T, H, D, E, w, causal != 0, scale, ldq, ldk, ldv};                                \
    if (!shape_ok(s, 16, kQ)) return 1;                                                                \
    run_heads<Worker>(s, BWD, nthreads, [&](Worker& wk, idx n) { wk.CALL; });                          \
    return 0
#else
#define TN_SOFTMAX_F32_RUN(BWD, CALL) return 2
#endif

int tn_softmax_fwd_f32(const float* q, const float* k, const float* v, idx ldq, idx ldk, idx ldv, float* o, float* stats,
                       idx B, idx T, idx H, idx D, idx E, idx w, int causal, float scale, int nthreads) {
    TN_SOFTMAX_F32_RUN(false, forward(q, k, v, o, stats, n));
}

int tn_softmax_bwd_f32(const float* q, const float* k, const float* v, idx ldq, idx ldk, idx ldv, const float* o,
                       const float* dout, const float* stats, float* dq, float* dk, float* dv, idx B, idx T, idx H,
                       idx D, idx E, idx w, int causal, float scale, int nthreads) {
    TN_SOFTMAX_F32_RUN(true, backward(q, k, v, o, dout, stats, dq, dk, dv, n));
}

}  // extern "C"
