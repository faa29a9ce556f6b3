// Fused CPU kernel for causal linear attention without denominator (NormAttention's core).
//
// Why this file exists: the PyTorch form of the chunked algorithm runs every product as a
// batched 64x64x64 GEMM over [B*H*G, c, D] tensors. Each such call streams its operands from
// memory, and the layout copies, the masks and the prefix scan add as many passes again. Here
// a thread walks the sequence chunk by chunk and, for each of its heads, does every product of
// that chunk while the tiles are in L1/L2, reading q, k, v, dO in their [B, T, H, D] layout.
// The bidirectional form (S = S_0 + K^T V, O = Q S) is walked the same way, reading each tensor
// once per pass and streaming its outputs, where PyTorch's GEMMs on the strided views also read
// and write the output lines. In both forms each step's products ask for the next step's tiles
// as they run (tn::RowPrefetch, _native_common.h): timed apart, the tile copies and the products of
// the bidirectional forward took 4.4 and 4.5 ms at T = 16k (fp32, 8 heads of 64), and together
// 8.8, as the copies waited on their misses with the arithmetic idle. With the requests, fp32
// fwd+bwd: causal 10.3 -> 9.2 ms at 4k, 41.5 -> 36.4 at 16k; bidirectional 5.65 -> 4.80 and
// 24.6 -> 19.2-20.1.
//
// Built at first use by transnormer/ops/_native.py with the system C++ compiler
// (-O3 -march=native) and loaded with ctypes; without a compiler the PyTorch path runs.
//
// Layouts (all contiguous): q, k [B, T, H, D]; v, o [B, T, H, E]; states [B, H, D, E].
// Math per head, chunks g of c rows, M the lower-triangular (j <= i) mask:
//   forward:  S_g = S_0 + sum_{h<g} K_h^T V_h,   O_g = (Q_g K_g^T . M) V_g + Q_g S_g
//   backward: dQ_g = (dO_g V_g^T . M) K_g + dO_g S_g^T
//             R_g  = dS_final + sum_{h>g} Q_h^T dO_h
//             dK_g = (dO_g V_g^T . M)^T Q_g + V_g R_g^T,  dV_g = (Q_g K_g^T . M)^T dO_g + K_g R_g
//             dS_0 = R_{-1} (the sum over all chunks)
// Nothing is stored between forward and backward: the backward recomputes the prefix states
// (a pass in chunk order for dQ) and the score tiles (a pass in reverse order for dK, dV).

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include "_native_common.h"
#include "_native_gemm.h"
#include "_native_simd.h"

using tn::RowPrefetch;

// dst[C x R] (ld_d) = src[R x C] (ld_s) transposed.
template <typename T>
static void transpose_scalar(idx R, idx C, const T* src, idx ld_s, T* dst, idx ld_d) {
    constexpr idx bs = 16;
    for (idx r0 = 0; r0 < R; r0 += bs)
        for (idx c0 = 0; c0 < C; c0 += bs) {
            const idx r1 = std::min(R, r0 + bs), c1 = std::min(C, c0 + bs);
            for (idx r = r0; r < r1; ++r)
                for (idx cc = c0; cc < c1; ++cc) dst[cc * ld_d + r] = src[r * ld_s + cc];
        }
}

template <typename T>
static void transpose(idx R, idx C, const T* src, idx ld_s, T* dst, idx ld_d) {
    transpose_scalar(R, C, src, ld_s, dst, ld_d);
}

#if defined(__AVX512F__)
using tn::transpose16;

template <>
void transpose<float>(idx R, idx C, const float* src, idx ld_s, float* dst, idx ld_d) {
    const idx R16 = R / 16 * 16, C16 = C / 16 * 16;
    for (idx r0 = 0; r0 < R16; r0 += 16)
        for (idx c0 = 0; c0 < C16; c0 += 16) transpose16(src + r0 * ld_s + c0, ld_s, dst + c0 * ld_d + r0, ld_d);
    if (C16 < C) transpose_scalar(R, C - C16, src + C16, ld_s, dst + C16 * ld_d, ld_d);
    if (R16 < R) transpose_scalar(R - R16, C16, src + R16 * ld_s, ld_s, dst + R16, ld_d);
}
#endif

// Zero the strictly upper triangle (j > i) of an L x L tile.
template <typename T>
static void mask_upper(idx L, T* a, idx lda) {
    for (idx i = 0; i + 1 < L; ++i) std::fill(a + i * lda + i + 1, a + i * lda + L, T(0));
}

// ---------------------------------------------------------------------------------------------
// Drivers: tiles, packing, the per-thread walk over chunks and heads
// ---------------------------------------------------------------------------------------------

struct Shape {
    idx B, T, H, D, E, c;
};

// Per-thread tiles. Rows of a head inside [B, T, H, D] are H*D elements apart, a power-of-two
// stride that maps a tile's rows onto a few L1 sets; every chunk is therefore first packed into
// contiguous tiles (one read from memory), and results are written back once.
template <typename T>
struct Scratch {
    tn::buffer<T> q, k, v, g, o, o2, kt, vt, a, da, rt;
    explicit Scratch(const Shape& s)
        : q(s.c * s.D), k(s.c * s.D), v(s.c * s.E), g(s.c * s.E), o(s.c * s.D), o2(s.c * s.E), kt(s.D * s.c),
          vt(s.E * s.c), a(s.c * s.c), da(s.c * s.c), rt(s.E * s.D) {}
};

// dst[R x C] (contiguous) = src[R x C] (row stride ld); unpack is the reverse.
// Explicit vector loads/stores: GCC turns a plain copy loop into a libc memcpy call per
// 256-byte row, and the call costs more than the copy.
template <typename T>
static inline void copy_rows(idx R, idx C, const T* __restrict src, idx ld_s, T* __restrict dst, idx ld_d) {
#if defined(TN_GEMM_SIMD)
    typedef Vec<T> V;
    const idx Cv = C / V::W * V::W;
    const typename V::mask tail = V::tail(int(C - Cv));  // (used only when C - Cv > 0)
    for (idx r = 0; r < R; ++r) {
        const T* a = src + r * ld_s;
        T* b = dst + r * ld_d;
        for (idx j = 0; j < Cv; j += V::W) V::store(b + j, V::load(a + j));
        if (Cv < C) V::storem(b + Cv, V::loadm(a + Cv, tail), tail);
    }
#else
    for (idx r = 0; r < R; ++r) std::copy(src + r * ld_s, src + r * ld_s + C, dst + r * ld_d);
#endif
}
template <typename T>
static void pack(idx R, idx C, const T* src, idx ld, T* dst) { copy_rows(R, C, src, ld, dst, C); }
// unpack writes results to the output tensors: with streaming stores when the rows are whole
// 64-byte lines, so the lines are not read from memory only to be overwritten (at long T the
// op is bound by memory traffic). An sfence ends the walk (Worker's destructor).
template <typename T>
static void unpack(idx R, idx C, const T* src, T* dst, idx ld) {
#if defined(TN_GEMM_SIMD)
    typedef Vec<T> V;
    if (!((reinterpret_cast<uintptr_t>(dst) | uintptr_t(ld * sizeof(T)) | uintptr_t(C * sizeof(T))) & 63)) {
        for (idx r = 0; r < R; ++r)
            for (idx j = 0; j < C; j += V::W) V::stream(dst + r * ld + j, V::load(src + r * C + j));
        return;
    }
#endif
    copy_rows(R, C, src, C, dst, ld);
}

// One thread's work: heads [lo, hi) of the B*H heads, walked chunk by chunk. For chunk g every
// head's products are done before chunk g+1, so the rows read are [c, H, D] slabs, long runs of
// memory the hardware prefetcher streams (head by head they would be 256-byte pieces 2 KB apart).
template <typename T>
struct Worker {
    const Shape& s;
    idx lo, hi;
    Scratch<T> w;
    Worker(const Shape& s_, idx lo_, idx hi_) : s(s_), lo(lo_), hi(hi_), w(s_) {}
#if defined(TN_GEMM_SIMD)
    ~Worker() { _mm_sfence(); }  // the streamed output rows (gemm and unpack stream on both widths)
#endif

    idx ldd() const { return s.H * s.D; }
    idx lde() const { return s.H * s.E; }
    // Row t0 of head n in a [B, T, H, D] (or [B, T, H, E]) tensor.
    template <typename P> P* rd(P* base, idx n, idx t0) const {
        return base + ((n / s.H) * s.T + t0) * ldd() + (n % s.H) * s.D;
    }
    template <typename P> P* re(P* base, idx n, idx t0) const {
        return base + ((n / s.H) * s.T + t0) * lde() + (n % s.H) * s.E;
    }
    idx nchunks() const { return (s.T + s.c - 1) / s.c; }
    idx rows(idx g) const { return std::min(s.c, s.T - g * s.c); }

    // states[(n - lo)] = init (optionally transposed to [E x D]) or zeros.
    tn::buffer<T> load_states(const T* init, bool transposed) const {
        const idx DE = s.D * s.E;
        tn::buffer<T> st((hi - lo) * DE, T(0));
        if (init)
            for (idx n = lo; n < hi; ++n) {
                if (transposed) transpose<T>(s.D, s.E, init + n * DE, s.E, st.data() + (n - lo) * DE, s.D);
                else std::copy(init + n * DE, init + (n + 1) * DE, st.begin() + (n - lo) * DE);
            }
        return st;
    }
    void store_states(const tn::buffer<T>& st, T* out) const {
        if (out) std::copy(st.begin(), st.end(), out + lo * s.D * s.E);
    }

    // Each output chunk of the causal walk is the sum of two products; the second adds the first's
    // partial sum from the tile and writes the total to the output (product_to), streamed from its
    // registers where the rows are whole 64-byte lines, instead of a tile pass by unpack().
    // fwd+bwd, 8 heads of 64 (benchmarks/ab_kernels.py, medians of 21, two runs in each order):
    // 3.7-4.9% less time at 4k (9.04 -> 8.62 ms), 4.5-6.3% at 16k (35.6 -> 33.4).
    void forward(const T* q, const T* k, const T* v, T* o, const T* init, T* fin) {
        const idx D = s.D, E = s.E, c = s.c, ldd_ = ldd(), lde_ = lde(), G = nchunks();
        tn::buffer<T> states = load_states(init, false);
        T *q_ = w.q.data(), *v_ = w.v.data(), *o_ = w.o2.data(), *a_ = w.a.data(), *kt = w.kt.data();
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g);
                T* S = states.data() + (n - lo) * D * E;
                pack(L, D, rd(q, n, t0), ldd_, q_);
                pack(L, E, re(v, n, t0), lde_, v_);
                transpose<T>(L, D, rd(k, n, t0), ldd_, kt, c);              // K^T: [D x L]
                gemm<T>(L, L, D, q_, D, 1, kt, c, a_, c, false, kOutLower);  // A = Q K^T
                mask_upper<T>(L, a_, c);
                RowPrefetch p1, p2;
                queue_next(p1, q, n, g, false), queue_next(p1, v, n, g, true), queue_next(p2, k, n, g, false);
                gemm<T>(L, E, D, q_, D, 1, S, E, o_, E, false, kFull, &p1);  // O = Q S
                product_to(L, E, L, a_, c, 1, v_, E, re(o, n, t0), lde_, o_, nullptr, true, kALower);  // O += A V
                gemm<T>(D, E, L, kt, c, 1, v_, E, S, E, true, kFull, &p2);   // S += K^T V
            }
        store_states(states, fin);
    }

    void backward(const T* q, const T* k, const T* v, const T* dout, const T* init, const T* dfin, T* dq, T* dk,
                  T* dv, T* dinit) {
        const idx D = s.D, E = s.E, c = s.c, ldd_ = ldd(), lde_ = lde(), G = nchunks(), DE = D * E;
        T *q_ = w.q.data(), *k_ = w.k.data(), *g_ = w.g.data();  // g_: a chunk of dO
        T *o_ = w.o.data(), *o2_ = w.o2.data(), *a_ = w.a.data(), *da_ = w.da.data();
        T *rt_ = w.rt.data(), *kt = w.kt.data(), *vt = w.vt.data();
        tn::buffer<T> Rs = load_states(dfin, false);  // R = dS_final + suffix sums of Q^T dO
        // Forward order: prefix states give dQ. S is kept transposed ([E x D]) because that is
        // the operand dQ = dO S^T needs: S^T += V^T K.
        tn::buffer<T> St = load_states(init, true);
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g);
                T* st = St.data() + (n - lo) * DE;
                pack(L, D, rd(k, n, t0), ldd_, k_);
                pack(L, E, re(dout, n, t0), lde_, g_);
                transpose<T>(L, E, re(v, n, t0), lde_, vt, c);                // V^T: [E x L]
                gemm<T>(L, L, E, g_, E, 1, vt, c, da_, c, false, kOutLower);  // dA = dO V^T
                mask_upper<T>(L, da_, c);
                RowPrefetch p1, p2;
                queue_next(p1, k, n, g, false), queue_next(p1, dout, n, g, true), queue_next(p2, v, n, g, true);
                gemm<T>(L, D, E, g_, E, 1, st, D, o_, D, false, kFull, &p1);  // dQ = dO S^T
                product_to(L, D, L, da_, c, 1, k_, D, rd(dq, n, t0), ldd_, o_, nullptr, true, kALower);  // dQ += dA K
                gemm<T>(E, D, L, vt, c, 1, k_, D, st, D, true, kFull, &p2);   // S^T += V^T K
            }
        // Reverse order: suffix sums R_g of Q^T dO give dK, dV.
        for (idx g = G - 1; g >= 0; --g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g);
                T* R = Rs.data() + (n - lo) * DE;
                pack(L, D, rd(q, n, t0), ldd_, q_);
                pack(L, E, re(dout, n, t0), lde_, g_);
                transpose<T>(L, D, rd(k, n, t0), ldd_, kt, c);                // K^T: [D x L]
                transpose<T>(L, E, re(v, n, t0), lde_, vt, c);                // V^T: [E x L]
                gemm<T>(L, L, E, g_, E, 1, vt, c, da_, c, false, kOutLower);  // dA = dO V^T
                mask_upper<T>(L, da_, c);
                gemm<T>(L, L, D, q_, D, 1, kt, c, a_, c, false, kOutLower);   // A = Q K^T
                mask_upper<T>(L, a_, c);
                transpose<T>(D, E, R, E, rt_, D);
                RowPrefetch p1, p2;
                queue_next(p1, q, n, g, false, true), queue_next(p1, dout, n, g, true, true);
                queue_next(p2, k, n, g, false, true), queue_next(p2, v, n, g, true, true);
                gemm<T>(L, D, E, vt, 1, c, rt_, D, o_, D, false, kFull, &p1);  // dK = V R^T
                product_to(L, D, L, da_, 1, c, q_, D, rd(dk, n, t0), ldd_, o_, nullptr, true, kAUpper);  // dK += dA^T Q
                gemm<T>(L, E, D, kt, 1, c, R, E, o2_, E, false, kFull, &p2);   // dV = K R
                product_to(L, E, L, a_, 1, c, g_, E, re(dv, n, t0), lde_, o2_, nullptr, true, kAUpper);  // dV += A^T dO
                gemm<T>(D, E, L, q_, 1, D, g_, E, R, E, true);               // R += Q^T dO
            }
        store_states(Rs, dinit);
    }

    // out (L rows of one head, row stride ld) = A B (+ tile, the partial sum of earlier products,
    // when acc), A, B and tri as gemm takes them: written by the product itself with streaming
    // stores where out's rows are whole 64-byte lines (the bidirectional walk's note below), else
    // into `tile` [L x N] and then by unpack().
    void product_to(idx L, idx N, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb, T* out, idx ld, T* tile,
                    RowPrefetch* pf, bool acc = false, Tri tri = kFull) {
        if (stream_ok(out, ld, N)) return gemm<T>(L, N, K, a, ars, acs, b, ldb, tile, N, acc, tri, pf, true, out, ld);
        gemm<T>(L, N, K, a, ars, acs, b, ldb, tile, N, acc, tri, pf);
        unpack(L, N, tile, out, ld);
    }

    // The L x C rows of x (row stride ld) as an operand that a product with N columns sweeps once
    // per panel (K^T or B): in place when N fits one panel of the micro-kernel (bidirectional walk's
    // note), else packed into tile. Sets ld_out, the operand's row stride.
    const T* operand_rows(idx L, idx C, const T* x, idx ld, idx N, T* tile, idx& ld_out) const {
        if (N <= gemm_panel<T>()) return ld_out = ld, x;
        pack(L, C, x, ld, tile);
        return ld_out = C, tile;
    }

    // The same rows as the A of a product (A read in rows: C = x B with B [C x N]): in place also
    // where gemm reads each row block of it once for all the panels (gemm_rows_outer).
    const T* a_rows(idx L, idx C, const T* x, idx ld, idx N, T* tile, idx& ld_out) const {
        if (gemm_rows_outer<T>(C, N)) return ld_out = ld, x;
        return operand_rows(L, C, x, ld, N, tile, ld_out);
    }

    // Queue into pf the rows of x (E wide if e, else D) that the walk's next step reads: head
    // n + 1 of chunk g, or the first head of the next chunk (g + 1, or g - 1 walking in reverse);
    // none after the last.
    void queue_next(RowPrefetch& pf, const T* x, idx n, idx g, bool e, bool reverse = false) const {
        idx n2 = n, g2 = g;
        if (!tn::next_step(n2, g2, lo, hi, nchunks(), reverse)) return;
        const idx t0 = g2 * s.c, sz = idx(sizeof(T));
        if (e) pf.add(re(x, n2, t0), lde() * sz, s.E * sz, rows(g2));
        else pf.add(rd(x, n2, t0), ldd() * sz, s.D * sz, rows(g2));
    }

    // Bidirectional form, per head: S = S_0 + K^T V (all rows), O = Q S. The rows are walked in
    // chunks of c as above (one pass for S, one for O), so each tile is read once per pass. The
    // next step's tiles are asked for during each product (file header): forward alone at 4k
    // 1.86 -> 1.48 ms, at 16k 9.0 -> 6.9; the same requests in one burst before each product
    // gained half as much at 4k and 9% at 16k, and two steps ahead or chunks of 32 or 128 rows
    // were no better. Where the output rows are whole 64-byte lines, the products whose result
    // is final (O, dQ, dK, dV) write it to the output with streaming stores from their registers
    // instead of into a tile that unpack() then streams: fwd+bwd (8 heads of 64, medians of 21
    // interleaved in one process, two runs) 5.04 -> 4.75 and 5.58 -> 5.02 ms at 4k, 20.1 -> 18.9
    // and 21.5 -> 20.1 at 16k. Where the products' results are one panel wide (D, E <= 64 in
    // fp32) they read q, k, v, dO in place (operand_rows), with no copy into tiles. First the products
    // that read each row of their A once (O = Q S, dK = V dS^T, dV = K dS): fwd+bwd in nine
    // interleaved runs faster at 4k in all nine (0.4-7%), at 16k in seven (2-6%). These read A in
    // place at any width where B fits L1, since gemm goes row block by row block then: with AVX2's
    // 16-column panels they had packed q, v, k into tiles; in place (Zen 3, three runs of
    // benchmarks/ab_kernels.py, one swapped) 2.5-3.9% less time at 4k, 1.6-2.8% less at 16k in two
    // runs and 1.3% more in one; the causal walk level (its A tiles are packed anyway). Then those that
    // sweep their operands eleven times (S += K^T V, dS += Q^T dO, whose rows, 2 KB apart, share
    // a few L1 sets: the lines come back from L2), in six runs of benchmarks/ab_kernels.py, three
    // in each order: 2.1-3.9% less time at 4k; at 16k 2.2-5.7% less in five, 3.0% more in one.
    void bidir_forward(const T* q, const T* k, const T* v, T* o, const T* init, T* fin) {
        const idx D = s.D, E = s.E, c = s.c, ldd_ = ldd(), lde_ = lde(), G = nchunks();
        tn::buffer<T> states = load_states(init, false);
        T *k_ = w.k.data(), *v_ = w.v.data(), *q_ = w.q.data(), *o_ = w.o2.data();
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g), W = std::max(D, E);
                idx lk, lv;
                const T* ka = operand_rows(L, D, rd(k, n, t0), ldd_, W, k_, lk);
                const T* va = operand_rows(L, E, re(v, n, t0), lde_, W, v_, lv);
                RowPrefetch pf;
                queue_next(pf, k, n, g, false), queue_next(pf, v, n, g, true);
                gemm<T>(D, E, L, ka, 1, lk, va, lv, states.data() + (n - lo) * D * E, E, true, kFull, &pf);  // S += K^T V
            }
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g);
                RowPrefetch pf;
                queue_next(pf, q, n, g, false);
                idx lq;
                const T* qa = a_rows(L, D, rd(q, n, t0), ldd_, E, q_, lq);
                product_to(L, E, D, qa, lq, 1, states.data() + (n - lo) * D * E, E, re(o, n, t0), lde_, o_, &pf);  // O = Q S
            }
        store_states(states, fin);
    }

    // Given S (the forward's final state): dQ = dO S^T and dS = dS_final + Q^T dO in one pass
    // (dO read once), then dK = V dS^T, dV = K dS; dS_0 = dS.
    void bidir_backward(const T* q, const T* k, const T* v, const T* dout, const T* S, const T* dfin, T* dq, T* dk,
                        T* dv, T* dinit) {
        const idx D = s.D, E = s.E, c = s.c, ldd_ = ldd(), lde_ = lde(), G = nchunks(), DE = D * E;
        tn::buffer<T> dS = load_states(dfin, false), St = load_states(S, true);  // S^T: [E x D]
        T *q_ = w.q.data(), *k_ = w.k.data(), *v_ = w.v.data(), *g_ = w.g.data(), *o_ = w.o.data(), *o2_ = w.o2.data();
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g), h = (n - lo) * DE, W = std::max(D, E);
                idx lq, lg;
                const T* qa = operand_rows(L, D, rd(q, n, t0), ldd_, W, q_, lq);
                const T* ga = operand_rows(L, E, re(dout, n, t0), lde_, W, g_, lg);
                RowPrefetch pq, pg;
                queue_next(pq, q, n, g, false), queue_next(pg, dout, n, g, true);
                gemm<T>(D, E, L, qa, 1, lq, ga, lg, dS.data() + h, E, true, kFull, &pq);  // dS += Q^T dO
                product_to(L, D, E, ga, lg, 1, St.data() + h, D, rd(dq, n, t0), ldd_, o_, &pg);  // dQ = dO S^T
            }
        tn::buffer<T> dSt((hi - lo) * DE);
        for (idx n = lo; n < hi; ++n) transpose<T>(D, E, dS.data() + (n - lo) * DE, E, dSt.data() + (n - lo) * DE, D);
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx t0 = g * c, L = rows(g), h = (n - lo) * DE;
                RowPrefetch pv, pk;
                queue_next(pv, v, n, g, true), queue_next(pk, k, n, g, false);
                idx lv, lk;
                const T* va = a_rows(L, E, re(v, n, t0), lde_, D, v_, lv);
                product_to(L, D, E, va, lv, 1, dSt.data() + h, D, rd(dk, n, t0), ldd_, o_, &pv);  // dK = V dS^T
                const T* ka = a_rows(L, D, rd(k, n, t0), ldd_, E, k_, lk);
                product_to(L, E, D, ka, lk, 1, dS.data() + h, E, re(dv, n, t0), lde_, o2_, &pk);  // dV = K dS
            }
        store_states(dS, dinit);
    }
};

static bool valid(idx B, idx T, idx H, idx D, idx E, idx c) { return B >= 1 && T >= 1 && H >= 1 && D >= 1 && E >= 1 && c >= 1; }

// Check the shape, then run call(worker) with the heads split over threads; each thread owns its
// scratch and its heads' states.
template <typename T, typename F>
static int run_heads(idx B, idx Tn, idx H, idx D, idx E, idx c, int nthreads, F call) {
    if (!valid(B, Tn, H, D, E, c)) return 1;
    const Shape s{B, Tn, H, D, E, c};
    tn::parallel_ranges(B * H, nthreads, [&](idx lo, idx hi) {
        Worker<T> w(s, lo, hi);
        call(w);
    });
    return 0;
}

constexpr idx kBidirChunk = 64;  // rows per step of the bidirectional walk (any size gives the same sums)

extern "C" {

int tn_abi_version() { return 13; }
// The error the kernels called from this thread recorded (tn::parallel_ranges) since the last
// take, and reset it.
int tn_take_error() { return std::exchange(tn::call_error(), 0); }

#define TN_DEFINE(SUFFIX, T)                                                                                    \
    int tn_causal_fwd_##SUFFIX(const T* q, const T* k, const T* v, T* o, const T* init, T* fin, idx B, idx Tn,   \
                               idx H, idx D, idx E, idx c, int nthreads) {                                      \
        return run_heads<T>(B, Tn, H, D, E, c, nthreads,                                                        \
                            [&](Worker<T>& w) { w.forward(q, k, v, o, init, fin); });                           \
    }                                                                                                           \
    int tn_causal_bwd_##SUFFIX(const T* q, const T* k, const T* v, const T* dout, const T* init, const T* dfin,  \
                               T* dq, T* dk, T* dv, T* dinit, idx B, idx Tn, idx H, idx D, idx E, idx c,         \
                               int nthreads) {                                                                  \
        return run_heads<T>(B, Tn, H, D, E, c, nthreads,                                                        \
                            [&](Worker<T>& w) { w.backward(q, k, v, dout, init, dfin, dq, dk, dv, dinit); });   \
    }                                                                                                           \
    int tn_bidir_fwd_##SUFFIX(const T* q, const T* k, const T* v, T* o, const T* init, T* fin, idx B, idx Tn,    \
                              idx H, idx D, idx E, int nthreads) {                                              \
        return run_heads<T>(B, Tn, H, D, E, kBidirChunk, nthreads,                                              \
                            [&](Worker<T>& w) { w.bidir_forward(q, k, v, o, init, fin); });                     \
    }                                                                                                           \
    int tn_bidir_bwd_##SUFFIX(const T* q, const T* k, const T* v, const T* dout, const T* S, const T* dfin,      \
                              T* dq, T* dk, T* dv, T* dinit, idx B, idx Tn, idx H, idx D, idx E, int nthreads) { \
        return run_heads<T>(B, Tn, H, D, E, kBidirChunk, nthreads,                                              \
                            [&](Worker<T>& w) { w.bidir_backward(q, k, v, dout, S, dfin, dq, dk, dv, dinit); }); \
    }

TN_DEFINE(f32, float)
TN_DEFINE(f64, double)

}  // extern "C"
