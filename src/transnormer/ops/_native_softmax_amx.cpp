// bf16 softmax attention, forward and backward, in the FlashAttention-2 scheme: the quadratic
// baseline's attention (vanilla-lm) and DiagAttention's blocks. The products run on AMX tiles or
// on AVX512-BF16 dot products (_native_amx.h; without AMX, 1.4-2.4x the fp32 kernel on upcast
// copies for vanilla shapes, 1.7-1.9x PyTorch's bf16 form for 64-token blocks).
//
// Why this file exists: under bf16 autocast PyTorch's CPU SDPA kernel runs the forward at about
// a third of the AMX rate but its backward at a tenth (16k tokens, 8 heads of 64: 0.38 s forward,
// 2.2 s backward), so the softmax baseline spent ~75% of a bf16 training step there and was
// measured against the linear models at a fraction of the speed its FLOPs allow.
//
// Layouts: q, k [B, T, H, D], v [B, T, H, E] bf16, each token's [H, D] row contiguous and the
// tokens at a row stride (ldq, ldk, ldv elements; the batch stride T times it), so views of a
// fused q/k/v projection are read in place; o, dO, dq, dk, dv contiguous [B, T, H, D|E];
// stats [B, H, 2, T] fp32, each query's raw score max and log2 of its sum, saved by the forward
// (_native_softmax_walk.h).
// Keys of query i: all (window w = 0) or those of i's block [floor(i/w) w, floor(i/w) w + w)
// (w > 0, a multiple of 32), and only j <= i when causal.
//
// Numerics (as FlashAttention-2 on GPUs): S = scale Q K^T in fp32 from bf16 operands; P =
// exp(S - running max) in fp32, its row sums in fp32, P rounded to bf16 as the operand of P V;
// O accumulated in fp32, divided by the row sum and rounded once. The backward recomputes P
// from the stats (bitwise the forward's S), delta = rowsum(dO * O), dS = P (dP - delta) in fp32, and
// rounds P and dS to bf16 as operands; dQ, dK, dV accumulate in fp32 and are rounded once.
//
// The walk: heads are split over threads; each head's rows are first packed (zero-padded to a
// multiple of 64) into the operand layouts, so every product below is whole tiles in L1/L2.
// Scores are computed transposed (keys x queries, queries along the vector lanes; see below).
// Forward: query blocks of 32, keys in steps of 64 with the online softmax, O^T = V^T P^T
// accumulated in fp32. Backward: key steps of 64 outer (dK, dV accumulate in fp32), query
// blocks of 64 inner, dQ^T accumulated in an fp32 copy of the head. Nothing per score is
// stored: the forward keeps the stats, the backward recomputes P.

#include "_native_amx.h"
#include "_native_softmax_walk.h"

#if defined(TN_BF16)
#include <limits>

namespace {
using namespace tn_amx;
using namespace tn_softmax;
using tn::half;
constexpr auto exp2_masked = tn::exp2_masked<5>;

constexpr idx kQ = 32;   // queries per block in the forward (two 16-lane vectors)
constexpr idx kQb = 64;  // queries per block in the backward: dK and dV then sum 64 queries per product
constexpr idx kGroupQ = 8;  // forward: query blocks that take each key step in turn
constexpr idx kGroupK = 4;  // backward: key steps that take each query block in turn

// Queries lie along the vector lanes: every score block is computed transposed, S^T = K Q^T
// [keys x queries], so the softmax's per-query max, sum and delta are lane-wise vector
// operations (no horizontal reductions or scalar work per query), and the causal mask is a
// lane mask per key (the helpers are in _native_simd.h).

// One VNNI word row from two rows a, b of a transposed block of nh 16-lane vectors: the pairs
// (a[n], b[n]) for every query lane n.
inline void store_pairs(w32* dst, const __m512* a, const __m512* b, int nh) {
    alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    for (int h = 0; h < nh; h += 2) {
        const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(a[h + 1], a[h]), y = (__m512i)_mm512_cvtne2ps_pbh(b[h + 1], b[h]);
        _mm512_storeu_si512(dst + 16 * h, _mm512_permutex2var_epi16(x, _mm512_load_si512(lo_idx), y));
        _mm512_storeu_si512(dst + 16 * h + 16, _mm512_permutex2var_epi16(x, _mm512_load_si512(hi_idx), y));
    }
}
// one row of a transposed block as bf16 (nh 16-lane vectors)
inline void store_row(bf* dst, const __m512* a, int nh) {
    for (int h = 0; h < nh; h += 2) _mm512_storeu_si512(dst + 16 * h, (__m512i)_mm512_cvtne2ps_pbh(a[h + 1], a[h]));
}

struct Worker : Walk {
    const idx D, E, Tp;  // Tp: T rounded up to kK
    tn::buffer<bf> qp, kp, vp, gp, kt, vt, pt, dt;
    tn::buffer<w32> qv, gv, qtv, gtv, tmp, pv, dsv;
    tn::buffer<float> st, dpt, acc, ml, dqt, dkv, tb, rows;

    Worker(const Shape& s_, bool backward)
        : Walk(s_), D(s_.D), E(s_.E), Tp((s_.T + kK - 1) / kK * kK), qp(Tp * D), kp(Tp * D), vp(Tp * E),
          qtv(Tp * D / 2), tmp(std::max(D, E) / 2 * kK), st(kK * kQb), tb(kQb * std::max(D, E)) {
        if (backward) {
            gp.resize(Tp * E), kt.resize(Tp * D), pt.resize(kK * kQb), dt.resize(kK * kQb);
            qv.resize(Tp * D / 2), gv.resize(Tp * E / 2), gtv.resize(Tp * E / 2), dsv.resize(kGroupK * kK / 2 * kQb);
            dpt.resize(kK * kQb), dqt.resize(Tp * D), dkv.resize(kGroupK * kK * (D + E)), rows.resize(3 * Tp);
        } else {
            vt.resize(Tp * E), acc.resize(kGroupQ * E * kQ), ml.resize(2 * kGroupQ * kQ), pv.resize(kK / 2 * kQ);
        }
        configure_tiles();
    }
    ~Worker() {
        _mm_sfence();  // the streamed output rows
        release_tiles();
    }

    // Operands that span the sequence are stored in blocks of the rows one product reads
    // ([Tp/blk][C/2][blk] words, [Tp/blk][C][blk] bf16), not as one [C x Tp] matrix: a tile
    // load reads 16 rows, and rows Tp apart (a multiple of 4 KB) would all fall in one L1 set.
    void blocked_vnni_of_transpose(idx C, const bf* x, idx blk, w32* dst) const {  // VNNI(X^T) per block
        for (idx b = 0; b < Tp; b += blk) vnni_of_transpose(blk, C, x + b * C, C, dst + b * C / 2);
    }
    void blocked_transpose(idx C, const bf* x, idx blk, bf* dst) {  // X^T per block
        for (idx b = 0; b < Tp; b += blk) {
            vnni_of_transpose(blk, C, x + b * C, C, tmp.data());
            unpair(C / 2, blk, tmp.data(), dst + b * C);
        }
    }

    // q, k, v rows of head n, zero-padded to Tp, and VNNI(Q^T) in blocks of nq queries
    void load_qkv(const bf* q, const bf* k, const bf* v, idx n, idx nq) {
        pack(T, Tp, D, q + at(n, 0, D, s.ldq), s.ldq, qp.data());
        pack(T, Tp, D, k + at(n, 0, D, s.ldk), s.ldk, kp.data());
        pack(T, Tp, E, v + at(n, 0, E, s.ldv), s.ldv, vp.data());
        blocked_vnni_of_transpose(D, qp.data(), nq, qtv.data());
    }
    // S^T [kK x nq] = K Q^T of key step j0 and query block i0, into st
    void scores(idx i0, idx nq, idx j0) {
        gemm(kK, nq, {D, kp.data() + j0 * D, D, qtv.data() + i0 * D / 2, nq, kDense}, nullptr, st.data(), nq, false);
    }
    // rows [r0, r0 + L) of a [B, T, H, width] output from an fp32 block X^T [width x nq]
    void write_transposed(const float* xt, idx width, idx nq, bf* out, idx n, idx r0, idx L) {
        for (idx a = 0; a < width; a += 16)
            for (idx b = 0; b < nq; b += 16) tn::transpose16(xt + a * nq + b, nq, tb.data() + b * width + a, width);
        stream_bf16_rows(L, width, tb.data(), width, out + at(n, r0, width, s.H * width), s.H * width);
    }

    // ---- forward: O^T = V^T P^T accumulated over key steps with the online softmax ----------
    // kGroupQ query blocks take each key step in turn, so a step's K and V^T rows are read from
    // memory once per 256 queries (per 32 they streamed from L3 at 16k tokens).

    // One key step of query block i0: its running max m, sum l (kQ floats each) and O^T (acc).
    void fwd_step(idx i0, idx j0, float* m, float* l, float* acc) {
        const __m512 c = _mm512_set1_ps(s.scale * kLog2e);
        scores(i0, kQ, j0);
        const bool full = all_visible(i0, kQ, j0);
        __m512 mx[2] = {_mm512_loadu_ps(m), _mm512_loadu_ps(m + 16)};  // the max of the raw scores seen
        for (idx r = 0; r < kK; ++r) {
            const Lanes vis = full ? ~Lanes(0) : visible(i0, j0 + r);
            for (int h = 0; h < 2; ++h)
                mx[h] = _mm512_mask_max_ps(mx[h], half(vis, h), mx[h], _mm512_loadu_ps(st.data() + r * kQ + 16 * h));
        }
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int h = 0; h < 2; ++h) {
            // a lane with no visible key yet keeps m = -inf: alpha 1, p 0
            __mmask16 moved;
            const __m512 alpha = tn::online_rescale(_mm512_loadu_ps(m + 16 * h), mx[h], c, moved);
            _mm512_storeu_ps(m + 16 * h, mx[h]);
            _mm512_storeu_ps(l + 16 * h, _mm512_mul_ps(_mm512_loadu_ps(l + 16 * h), alpha));
            if (moved)  // the max rose: rescale O^T
                for (idx e = 0; e < E; ++e) {
                    float* a = acc + e * kQ + 16 * h;
                    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), alpha));
                }
        }
        for (idx r = 0; r < kK; r += 2) {  // VNNI(P^T), p = 2^((s - m) c) on visible lanes
            __m512 p[2][2];
            for (int u = 0; u < 2; ++u) {
                const Lanes vis = full ? ~Lanes(0) : visible(i0, j0 + r + u);
                for (int h = 0; h < 2; ++h) {
                    const __m512 score = _mm512_loadu_ps(st.data() + (r + u) * kQ + 16 * h);
                    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(score, mx[h]), c);
                    p[u][h] = exp2_masked(half(vis, h), x);
                    sum[h] = _mm512_add_ps(sum[h], p[u][h]);
                }
            }
            store_pairs(pv.data() + (r / 2) * kQ, p[0], p[1], 2);
        }
        for (int h = 0; h < 2; ++h) _mm512_storeu_ps(l + 16 * h, _mm512_add_ps(_mm512_loadu_ps(l + 16 * h), sum[h]));
        gemm(E, kQ, {kK, vt.data() + j0 * E, kK, pv.data(), kQ, kDense}, nullptr, acc, kQ, true);
    }

    void forward(const bf* q, const bf* k, const bf* v, bf* o, float* stats, idx n) {
        load_qkv(q, k, v, n, kQ);
        blocked_transpose(E, vp.data(), kK, vt.data());  // V^T per key step
        for (idx g0 = 0; g0 < T; g0 += kQ * kGroupQ) {
            const idx nb = std::min(kGroupQ, (T - g0 + kQ - 1) / kQ);
            std::fill(ml.begin(), ml.end(), -std::numeric_limits<float>::infinity());  // m of each block
            std::fill(ml.begin() + kGroupQ * kQ, ml.end(), 0.0f);                         // l
            std::fill(acc.begin(), acc.end(), 0.0f);  // O^T [E x kQ] per block
            const idx last = g0 + (nb - 1) * kQ;
            for (idx j0 = fwd_start(g0); j0 < fwd_end(last, kQ); j0 += kK)
                for (idx b = 0; b < nb; ++b) {
                    const idx i0 = g0 + b * kQ;
                    if (j0 >= fwd_start(i0) && j0 < fwd_end(i0, kQ))
                        fwd_step(i0, j0, ml.data() + b * kQ, ml.data() + (kGroupQ + b) * kQ, acc.data() + b * E * kQ);
                }
            for (idx b = 0; b < nb; ++b) {  // O = (O^T / l)^T; the stats m, log2 l
                const idx i0 = g0 + b * kQ, L = std::min(kQ, T - i0);
                const float* m = ml.data() + b * kQ;
                const float* l = ml.data() + (kGroupQ + b) * kQ;
                float* a = acc.data() + b * E * kQ;
                for (int h = 0; h < 2; ++h) {
                    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + 16 * h));
                    for (idx e = 0; e < E; ++e)
                        _mm512_storeu_ps(a + e * kQ + 16 * h, _mm512_mul_ps(_mm512_loadu_ps(a + e * kQ + 16 * h), inv));
                }
                for (idx r = 0; r < L; ++r) store_stats(stats, n, i0 + r, m[r], l[r]);
                write_transposed(a, E, kQ, o, n, i0, L);
            }
        }
    }

    // ---- backward: key steps outer (dK, dV), query blocks inner (dQ^T accumulated) -----------
    // kGroupK key steps take each query block in turn, so the query-side operands (Q, dO in two
    // layouts each, dQ^T in fp32) are read once per 256 keys rather than once per 64.

    // Key step j0 (its dK, dV accumulators dkb, dvb) and query block i0 (its m, log2 l, delta in
    // mr, ll, dl).
    // VNNI(dS^T) of the step goes to dsv_out; the caller sums dQ^T over the group's steps.
    void bwd_step(idx i0, idx j0, const __m512* mr, const __m512* ll, const __m512* dl, float* dkb, float* dvb,
                  w32* dsv_out) {
        const __m512 c = _mm512_set1_ps(s.scale * kLog2e), scale = _mm512_set1_ps(s.scale);
        scores(i0, kQb, j0);
        gemm(kK, kQb, {E, vp.data() + j0 * E, E, gtv.data() + i0 * E / 2, kQb, kDense}, nullptr, dpt.data(), kQb,
             false);  // dP^T
        const bool full = all_visible(i0, kQb, j0);
        for (idx r = 0; r < kK; r += 2) {  // P^T, dS^T rows and VNNI(dS^T)
            __m512 ds[2][4];
            for (int u = 0; u < 2; ++u) {
                const idx row = r + u;
                const Lanes vis = full ? ~Lanes(0) : visible(i0, j0 + row);
                __m512 p[4];
                for (int h = 0; h < 4; ++h) {
                    const __m512 score = _mm512_loadu_ps(st.data() + row * kQb + 16 * h);
                    const __m512 x = _mm512_fmsub_ps(_mm512_sub_ps(score, mr[h]), c, ll[h]);
                    p[h] = tn::exp2_bits<5>(half(vis, h), x);  // (see exp2_bits: faster here)
                    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(dpt.data() + row * kQb + 16 * h), dl[h]);
                    ds[u][h] = _mm512_mul_ps(_mm512_mul_ps(p[h], d), scale);
                }
                store_row(pt.data() + row * kQb, p, 4);
                store_row(dt.data() + row * kQb, ds[u], 4);
            }
            store_pairs(dsv_out + (r / 2) * kQb, ds[0], ds[1], 4);
        }
        gemm(kK, E, {kQb, pt.data(), kQb, gv.data() + (i0 / 2) * E, E, kDense}, nullptr, dvb, E, true);
        gemm(kK, D, {kQb, dt.data(), kQb, qv.data() + (i0 / 2) * D, D, kDense}, nullptr, dkb, D, true);
    }

    void backward(const bf* q, const bf* k, const bf* v, const bf* o, const bf* dout, const float* stats, bf* dq,
                  bf* dk, bf* dv, idx n) {
        load_qkv(q, k, v, n, kQb);
        const idx ldo = s.H * E;
        pack(T, Tp, E, dout + at(n, 0, E, ldo), ldo, gp.data());
        blocked_vnni_of_transpose(E, gp.data(), kQb, gtv.data());  // VNNI(dO^T): dP^T = V dO^T
        vnni(Tp, D, qp.data(), D, qv.data());                      // VNNI(Q): dK = dS^T Q
        vnni(Tp, E, gp.data(), E, gv.data());                      // VNNI(dO): dV = P^T dO
        blocked_transpose(D, kp.data(), kK, kt.data());            // K^T per key step: dQ^T = K^T dS^T
        query_rows(stats, n, reinterpret_cast<const tn::bf16*>(o), ldo, reinterpret_cast<const tn::bf16*>(gp.data()), Tp,
                   rows.data());  // per query: m, log2 l, delta
        std::fill(dqt.begin(), dqt.end(), 0.0f);  // dQ^T per query block [Tp/kQb][D][kQb]
        for (idx g0 = 0; g0 < T; g0 += kK * kGroupK) {
            const idx nk = std::min(kGroupK, (T - g0 + kK - 1) / kK);
            std::fill(dkv.begin(), dkv.end(), 0.0f);
            const idx last = g0 + (nk - 1) * kK;
            for (idx i0 = bwd_start(g0, kQb); i0 < bwd_end(last); i0 += kQb) {
                __m512 mr[4], ll[4], dl[4];
                for (int h = 0; h < 4; ++h) {
                    mr[h] = _mm512_loadu_ps(rows.data() + i0 + 16 * h);
                    ll[h] = _mm512_loadu_ps(rows.data() + Tp + i0 + 16 * h);
                    dl[h] = _mm512_loadu_ps(rows.data() + 2 * Tp + i0 + 16 * h);
                }
                Pair dq[kGroupK];  // dQ^T += K_j^T dS_j^T over the group's steps, in one pass of the tiles
                int np = 0;
                for (idx c = 0; c < nk; ++c) {
                    const idx j0 = g0 + c * kK;
                    if (i0 < bwd_start(j0, kQb) || i0 >= bwd_end(j0)) continue;
                    w32* ds = dsv.data() + c * kK / 2 * kQb;
                    bwd_step(i0, j0, mr, ll, dl, dkv.data() + c * kK * D, dkv.data() + (kGroupK * D + c * E) * kK, ds);
                    dq[np++] = {kK, kt.data() + j0 * D, kK, ds, kQb, kDense};
                }
                if (np) gemm_sum(D, kQb, dq, np, dqt.data() + i0 * D, kQb, true);
            }
            for (idx c = 0; c < nk; ++c) {
                const idx j0 = g0 + c * kK, L = std::min(kK, T - j0);
                stream_bf16_rows(L, D, dkv.data() + c * kK * D, D, dk + at(n, j0, D, s.H * D), s.H * D);
                stream_bf16_rows(L, E, dkv.data() + (kGroupK * D + c * E) * kK, E, dv + at(n, j0, E, s.H * E), s.H * E);
            }
        }
        for (idx i0 = 0; i0 < T; i0 += kQb)
            write_transposed(dqt.data() + i0 * D, D, kQb, dq, n, i0, std::min(kQb, T - i0));
    }
};

}  // namespace
#endif  // TN_BF16

extern "C" {

typedef const uint16_t* in_t;  // bf16 tensors as their bits
typedef uint16_t* out_t;

// Status: 0 ok, 1 bad shape (D, E and w multiples of 32, scale > 0), 2 kernels unavailable.
#if defined(TN_BF16)
#define TN_SOFTMAX_RUN(BWD, CALL)                                                                      \
    if (tn_bf16_ready() != 1) return 2;                                                                 \
    const Shape s{B, T, H, D, E, w, causal != 0, scale, ldq, ldk, ldv};                                \
    if (!shape_ok(s, 32, kQ)) return 1;                                                                \
    run_heads<Worker>(s, BWD, nthreads, [&](Worker& wk, idx n) { wk.CALL; });                          \
    return 0
#else
#define TN_SOFTMAX_RUN(BWD, CALL) return 2
#endif

int tn_softmax_fwd_bf16(in_t q, in_t k, in_t v, idx ldq, idx ldk, idx ldv, out_t o, float* stats, idx B, idx T, idx H,
                        idx D, idx E, idx w, int causal, float scale, int nthreads) {
    TN_SOFTMAX_RUN(false, forward(q, k, v, o, stats, n));
}

int tn_softmax_bwd_bf16(in_t q, in_t k, in_t v, idx ldq, idx ldk, idx ldv, in_t o, in_t dout, const float* stats,
                        out_t dq, out_t dk, out_t dv, idx B, idx T, idx H, idx D, idx E, idx w, int causal,
                        float scale, int nthreads) {
    TN_SOFTMAX_RUN(true, backward(q, k, v, o, dout, stats, dq, dk, dv, n));
}

}  // extern "C"
