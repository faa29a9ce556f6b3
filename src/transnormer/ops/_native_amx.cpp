// bf16 linear attention without denominator, causal and bidirectional (the bf16 twin of
// _native_linear_attn.cpp), its products on AMX tiles or on AVX512-BF16 dot products
// (_native_amx.h: the engine is chosen when the library is built).
//
// Why this file exists: under bf16 autocast the chunked algorithm is a stream of 64x64x64
// products. PyTorch runs each as a oneDNN call on [B*H*G, 64, 64] batches at ~20% of the AMX
// rate, and the fp32 kernel would need the inputs upcast. Here every product of a chunk is a
// handful of AMX tile instructions (a 64^3 product is 32 TDPBF16PS, ~0.2 us) on tiles packed in
// L1, so the time goes to reading q, k, v, dO once per pass and repacking them. Without AMX the
// same walk on VDPBF16PS (a 64^3 product ~1.2 us on one Zen 5 core, its peak rate) took the
// causal op from the fp32 kernel on upcast copies at 12.1 ms to 5.7-7.4 ms (fwd+bwd, T = 4k,
// runs on different days).
//
// Same math and layouts as _native_linear_attn.cpp: q, k [B, T, H, D], v, o [B, T, H, E] in
// bf16; states (init, final, their gradients) [B, H, D, E] in fp32. Numerics follow the PyTorch
// form under autocast: every product takes bf16 operands (the fp32 state and the score tiles
// are rounded to bf16 as operands) and accumulates in fp32; the state itself accumulates in
// fp32 inside the tiles, and each output row is rounded to bf16 once.
//
// The product engines and operand packs are in _native_amx.h.
// Requirements (checked by the caller): D, E and the chunk c multiples of 32; the last, partial
// chunk is zero-padded. With AMX, Linux must grant the process the tile state (tn_bf16_ready).

#include "_native_amx.h"

#if defined(TN_BF16)
#if defined(TN_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
using namespace tn_amx;

// ---------------------------------------------------------------------------------------------
// The walk over chunks and heads (as in _native_linear_attn.cpp: chunk-major, heads split over
// threads, nothing stored between forward and backward)
// ---------------------------------------------------------------------------------------------

struct Shape {
    idx B, T, H, D, E, c;
};

// A chunk's rows of one head: read in place when the chunk is whole, else copied with zero
// rows below the last (the products then run on whole tiles).
struct Rows {
    const bf* p;
    idx ld;
};

struct Worker {
    const Shape& s;
    idx lo, hi;
    const idx c, D, E, W;  // W: the wider of D, E
    // zero-padded rows of a short last chunk; VNNI operands; a transposed operand; scores; states
    tn::buffer<bf> qa, ka, va, ga, ta, pa, sb;
    tn::buffer<w32> t1, t2, v1, v2, sv, sv2;
    tn::buffer<float> af, of;

    Worker(const Shape& s_, idx lo_, idx hi_)
        : s(s_), lo(lo_), hi(hi_), c(s_.c), D(s_.D), E(s_.E), W(std::max(s_.D, s_.E)),
          qa(c * D), ka(c * D), va(c * E), ga(c * E), ta(W * c), pa(c * c), sb(D * E), t1(W / 2 * c),
          t2(W / 2 * c), v1(c / 2 * W), v2(c / 2 * W), sv(D * E / 2), sv2(D * E / 2), af(c * c), of(c * W) {
        configure_tiles();
    }
    ~Worker() {
        _mm_sfence();  // the streamed output rows
        release_tiles();
    }

    idx nchunks() const { return (s.T + c - 1) / c; }
    idx rows(idx g) const { return std::min(c, s.T - g * c); }
    idx offset(idx n, idx t0, idx width) const { return ((n / s.H) * s.T + t0) * s.H * width + (n % s.H) * width; }
    Rows chunk(const bf* x, idx n, idx g, idx width, tn::buffer<bf>& pad) const {
        const idx L = rows(g), ld = s.H * width;
        if (L == c) return {x + offset(n, g * c, width), ld};
        pack(L, c, width, x + offset(n, g * c, width), ld, pad.data());
        return {pad.data(), width};
    }
    // An fp32 state X [R x C] as B operands: VNNI(bf16(X)) [R/2 x C] and/or VNNI(bf16(X)^T) [C/2 x R].
    void state_operands(const float* X, idx R, idx C, w32* plain, w32* transposed) {
        to_bf16_rows(R, C, X, C, sb.data(), C);
        if (plain) vnni(R, C, sb.data(), C, plain);
        if (transposed) vnni_of_transpose(R, C, sb.data(), C, transposed);
    }
    // x's rows of chunk g (width wide) = A1 B1 (+ A2 B2), rounded to bf16 (gemm_to_rows)
    void product_to(bf* x, idx n, idx g, idx width, const Pair& p1, const Pair* p2, tn::RowPrefetch* pf = nullptr) {
        gemm_to_rows(c, width, p1, p2, rows(g), x + offset(n, g * c, width), s.H * width, of.data(), pf);
    }

    // states[(n - lo)] = init (optionally transposed to [E x D]) or zeros.
    tn::buffer<float> load_states(const float* init, bool transposed = false) const {
        const idx DE = D * E;
        tn::buffer<float> st((hi - lo) * DE, 0.0f);
        if (init && !transposed) std::copy(init + lo * DE, init + hi * DE, st.begin());
        if (init && transposed)
            for (idx n = lo; n < hi; ++n)
                for (idx r0 = 0; r0 < D; r0 += 16)
                    for (idx c0 = 0; c0 < E; c0 += 16)
                        tn::transpose16(init + n * DE + r0 * E + c0, E, st.data() + (n - lo) * DE + c0 * D + r0, D);
        return st;
    }
    void store_states(const tn::buffer<float>& st, float* out) const {
        if (out) std::copy(st.begin(), st.end(), out + lo * D * E);
    }

    void forward(const bf* q, const bf* k, const bf* v, bf* o, const float* init, float* fin) {
        tn::buffer<float> states = load_states(init);
        const idx G = nchunks();
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                float* S = states.data() + (n - lo) * D * E;
                const Rows Q = chunk(q, n, g, D, qa), K = chunk(k, n, g, D, ka), V = chunk(v, n, g, E, va);
                vnni_of_transpose(c, D, K.p, K.ld, t1.data());  // VNNI(K^T) [D/2 x c]
                unpair(D / 2, c, t1.data(), ta.data());         // K^T [D x c]
                vnni(c, E, V.p, V.ld, v1.data());               // VNNI(V) [c/2 x E]
                state_operands(S, D, E, sv.data(), nullptr);   // VNNI(S) [D/2 x E]
                // A = Q K^T; O = A V + Q S; S += K^T V
                gemm(c, c, {D, Q.p, Q.ld, t1.data(), c, kDense}, nullptr, af.data(), c, false, kLowerC);
                to_bf16_rows(c, c, af.data(), c, pa.data(), c, kLower);
                const Pair QS{D, Q.p, Q.ld, sv.data(), E, kDense};
                tn::RowPrefetch p1, p2;
                queue_next(p1, q, n, g, D), queue_next(p1, v, n, g, E), queue_next(p2, k, n, g, D);
                product_to(o, n, g, E, {c, pa.data(), c, v1.data(), E, kLowerA}, &QS, &p1);
                gemm(D, E, {c, ta.data(), c, v1.data(), E, kDense}, nullptr, S, E, true, kAll, &p2);
            }
        store_states(states, fin);
    }

    void backward(const bf* q, const bf* k, const bf* v, const bf* dout, const float* init, const float* dfin, bf* dq,
                  bf* dk, bf* dv, float* dinit) {
        const idx G = nchunks(), DE = D * E;
        // Chunk order: the prefix states S give dQ. S is kept transposed, [E x D], the operand
        // dQ = dO S^T needs (S^T += V^T K).
        {
            tn::buffer<float> St = load_states(init, true);
            for (idx g = 0; g < G; ++g)
                for (idx n = lo; n < hi; ++n) {
                    float* st = St.data() + (n - lo) * DE;
                    const Rows K = chunk(k, n, g, D, ka), V = chunk(v, n, g, E, va), dO = chunk(dout, n, g, E, ga);
                    vnni_of_transpose(c, E, V.p, V.ld, t1.data());  // VNNI(V^T) [E/2 x c]
                    unpair(E / 2, c, t1.data(), ta.data());         // V^T [E x c]
                    vnni(c, D, K.p, K.ld, v1.data());               // VNNI(K) [c/2 x D]
                    state_operands(st, E, D, sv.data(), nullptr);   // VNNI(S^T) [E/2 x D]
                    // dA = dO V^T; dQ = dA K + dO S^T; S^T += V^T K
                    gemm(c, c, {E, dO.p, dO.ld, t1.data(), c, kDense}, nullptr, af.data(), c, false, kLowerC);
                    to_bf16_rows(c, c, af.data(), c, pa.data(), c, kLower);
                    const Pair dOS{E, dO.p, dO.ld, sv.data(), D, kDense};
                    tn::RowPrefetch p1, p2;
                    queue_next(p1, k, n, g, D), queue_next(p1, dout, n, g, E), queue_next(p2, v, n, g, E);
                    product_to(dq, n, g, D, {c, pa.data(), c, v1.data(), D, kLowerA}, &dOS, &p1);
                    gemm(E, D, {c, ta.data(), c, v1.data(), D, kDense}, nullptr, st, D, true, kAll, &p2);
                }
        }
        // Reverse order: R = dS_final + the suffix sums of Q^T dO give dK and dV.
        tn::buffer<float> Rs = load_states(dfin);
        for (idx g = G - 1; g >= 0; --g)
            for (idx n = lo; n < hi; ++n) {
                float* R = Rs.data() + (n - lo) * DE;
                const Rows Q = chunk(q, n, g, D, qa), K = chunk(k, n, g, D, ka);
                const Rows V = chunk(v, n, g, E, va), dO = chunk(dout, n, g, E, ga);
                vnni_of_transpose(c, E, dO.p, dO.ld, t2.data());  // VNNI(dO^T) [E/2 x c]
                vnni_of_transpose(c, D, Q.p, Q.ld, t1.data());    // VNNI(Q^T) [D/2 x c]
#if defined(TN_AMX)
                unpair(D / 2, c, t1.data(), ta.data());           // Q^T [D x c]
#endif
                vnni(c, D, Q.p, Q.ld, v1.data());                 // VNNI(Q) [c/2 x D]
                vnni(c, E, dO.p, dO.ld, v2.data());               // VNNI(dO) [c/2 x E]
                state_operands(R, D, E, sv2.data(), sv.data());   // VNNI(R) [D/2 x E], VNNI(R^T) [E/2 x D]
                // dA^T = V dO^T (upper triangular); dK = dA^T Q + V R^T
                gemm(c, c, {E, V.p, V.ld, t2.data(), c, kDense}, nullptr, af.data(), c, false, kUpperC);
                to_bf16_rows(c, c, af.data(), c, pa.data(), c, kUpper);
                const Pair VR{E, V.p, V.ld, sv.data(), D, kDense};
                tn::RowPrefetch p1, p2;
                queue_next(p1, q, n, g, D, true), queue_next(p1, dout, n, g, E, true);
                queue_next(p2, k, n, g, D, true), queue_next(p2, v, n, g, E, true);
                product_to(dk, n, g, D, {c, pa.data(), c, v1.data(), D, kUpperA}, &VR, &p1);
                // A^T = K Q^T (upper triangular); dV = A^T dO + K R
                gemm(c, c, {D, K.p, K.ld, t1.data(), c, kDense}, nullptr, af.data(), c, false, kUpperC);
                to_bf16_rows(c, c, af.data(), c, pa.data(), c, kUpper);
                const Pair KR{D, K.p, K.ld, sv2.data(), E, kDense};
                product_to(dv, n, g, E, {c, pa.data(), c, v2.data(), E, kUpperA}, &KR, &p2);
#if defined(TN_AMX)
                gemm(D, E, {c, ta.data(), c, v2.data(), E, kDense}, nullptr, R, E, true);  // R += Q^T dO
#else
                const PairsA qdo{c, v1.data(), D, v2.data(), E};  // Q^T in pairs: VNNI(Q)
                gemm_sum(D, E, &qdo, 1, R, E, true);               // R += Q^T dO
#endif
            }
        store_states(Rs, dinit);
    }

    // Per head of this thread (X: the thread's first head, fp32 [D x E] each): the VNNI form of
    // bf16(X), of X itself ([D/2 x E]) or of X^T ([E/2 x D]).
    tn::buffer<w32> vnni_states(const float* X, bool transposed) {
        tn::buffer<w32> out((hi - lo) * D * E / 2);
        for (idx n = lo; n < hi; ++n) {
            w32* o = out.data() + (n - lo) * D * E / 2;
            state_operands(X + (n - lo) * D * E, D, E, transposed ? nullptr : o, transposed ? o : nullptr);
        }
        return out;
    }

    // S [D x E] fp32 += X^T Y for a chunk's rows X [c x D], Y [c x E].
    // On AVX512-BF16, A = X^T goes in pairs (PairsA): one pass over X instead of two. The
    // bidirectional fwd+bwd at 16k, 8 heads of 64, medians of 21 interleaved in one process:
    // 14.2 -> 13.9 and 14.0 -> 13.7 ms in two runs (the same sums); at 4k within noise.
    // On AMX, X^T is made in one pass (transpose_rows): benchmarks/ab_kernels.py --dtype bf16 --mode
    // bidir, both orders, 0.975-0.988 of the time at 4k and 0.970-0.973 at 16k, the same sums. (In
    // the causal walk, which needs VNNI(X^T) as well, storing both from the registers read 1.015-1.025.)
    void add_outer(const Rows& X, const Rows& Y, float* S, tn::RowPrefetch* pf = nullptr) {
        vnni(c, E, Y.p, Y.ld, v1.data());  // VNNI(Y) [c/2 x E]
#if defined(TN_AMX)
        transpose_rows(c, D, X.p, X.ld, ta.data());  // X^T [D x c], the A tiles
        gemm(D, E, {c, ta.data(), c, v1.data(), E, kDense}, nullptr, S, E, true, kAll, pf);
#else
        vnni(c, D, X.p, X.ld, v2.data());  // VNNI(X) [c/2 x D]: X^T in pairs
        const PairsA xy{c, v2.data(), D, v1.data(), E};
        gemm_sum(D, E, &xy, 1, S, E, true, kAll, pf);
#endif
    }
    // Queue into pf the rows of x (width wide) that the walk's next step reads: head n + 1 of
    // chunk g, or the first head of the next chunk (g + 1, or g - 1 walking in reverse); none
    // after the last. Each product asks for them as it runs (tn::RowPrefetch). At T = 16k the
    // walks stream q, k, v, dO from beyond the caches; bf16 fwd+bwd, 8 heads of 64, interleaved
    // runs in one process: bidirectional 16.9 -> 14.3 ms, causal 34.6 -> 28.2 (medians of 15);
    // at 4k within noise. The prefetch it replaces (the same head's next chunk into L1, in one
    // burst before the step) measured as no prefetch at all in those runs.
    void queue_next(tn::RowPrefetch& pf, const bf* x, idx n, idx g, idx width, bool reverse = false) const {
        idx n2 = n, g2 = g;
        if (!tn::next_step(n2, g2, lo, hi, nchunks(), reverse)) return;
        const idx sz = idx(sizeof(bf));
        pf.add(x + offset(n2, g2 * c, width), s.H * width * sz, width * sz, rows(g2));
    }

    // Bidirectional form, per head: S = S_0 + K^T V (all rows), O = Q S; one pass over the
    // chunks for S, one for O.
    void bidir_forward(const bf* q, const bf* k, const bf* v, bf* o, const float* init, float* fin) {
        tn::buffer<float> states = load_states(init);
        const idx G = nchunks(), DE = D * E;
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                tn::RowPrefetch pf;
                queue_next(pf, k, n, g, D), queue_next(pf, v, n, g, E);
                add_outer(chunk(k, n, g, D, ka), chunk(v, n, g, E, va), states.data() + (n - lo) * DE, &pf);  // K^T V
            }
        const tn::buffer<w32> Sv = vnni_states(states.data(), false);
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                tn::RowPrefetch pf;
                queue_next(pf, q, n, g, D);
                const Rows Q = chunk(q, n, g, D, qa);
                product_to(o, n, g, E, {D, Q.p, Q.ld, Sv.data() + (n - lo) * DE / 2, E, kDense}, nullptr, &pf);
            }
        store_states(states, fin);
    }

    // Given S (the forward's final state): dQ = dO S^T and dS = dS_final + Q^T dO in one pass
    // (dO read once), then dK = V dS^T, dV = K dS; dS_0 = dS.
    void bidir_backward(const bf* q, const bf* k, const bf* v, const bf* dout, const float* S, const float* dfin,
                        bf* dq, bf* dk, bf* dv, float* dinit) {
        tn::buffer<float> dS = load_states(dfin);
        const idx G = nchunks(), DE = D * E;
        const tn::buffer<w32> St = vnni_states(S + lo * DE, true);  // VNNI(S^T) [E/2 x D]
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                tn::RowPrefetch p1, p2;
                queue_next(p1, q, n, g, D), queue_next(p2, dout, n, g, E);
                const Rows dO = chunk(dout, n, g, E, ga);
                add_outer(chunk(q, n, g, D, qa), dO, dS.data() + (n - lo) * DE, &p1);  // Q^T dO
                product_to(dq, n, g, D, {E, dO.p, dO.ld, St.data() + (n - lo) * DE / 2, D, kDense}, nullptr, &p2);  // dQ = dO S^T
            }
        const tn::buffer<w32> dSt = vnni_states(dS.data(), true), dSv = vnni_states(dS.data(), false);
        for (idx g = 0; g < G; ++g)
            for (idx n = lo; n < hi; ++n) {
                const idx h = (n - lo) * DE / 2;
                tn::RowPrefetch p1, p2;
                queue_next(p1, v, n, g, E), queue_next(p2, k, n, g, D);
                const Rows V = chunk(v, n, g, E, va), K = chunk(k, n, g, D, ka);
                product_to(dk, n, g, D, {E, V.p, V.ld, dSt.data() + h, D, kDense}, nullptr, &p1);  // dK = V dS^T
                product_to(dv, n, g, E, {D, K.p, K.ld, dSv.data() + h, E, kDense}, nullptr, &p2);  // dV = K dS
            }
        store_states(dS, dinit);
    }
};

bool shape_ok(idx B, idx T, idx H, idx D, idx E, idx c) {
    return B >= 1 && T >= 1 && H >= 1 && D >= 32 && E >= 32 && c >= 32 && D % 32 == 0 && E % 32 == 0 && c % 32 == 0;
}

#if defined(TN_AMX)
bool bf16_granted = false;  // asked for once, by tn_bf16_ready
#endif

// Rows per step of the bidirectional walk (any multiple of 32 gives the same sums). On AMX 32:
// benchmarks/ab_kernels.py --dtype bf16 --mode bidir against 64, both orders (Xeon with AMX, 2
// threads, 8 heads of 64): fwd+bwd 0.932 and 0.885 of the time at 4k, 0.919 and 0.896 at 16k;
// 256 rows took 1.25x / 1.17x. The AVX512-BF16 engine keeps the 64 it was measured with.
#if defined(TN_AMX)
constexpr idx kBidirChunk = 32;
#else
constexpr idx kBidirChunk = 64;
#endif

}  // namespace
#endif  // TN_BF16

extern "C" {

// 1 when this build has the bf16 kernels and they can run: with the AVX512-BF16 engine always;
// with the AMX engine once Linux grants the process the AMX tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). 0 otherwise. Call before the kernels.
int tn_bf16_ready() {
#if defined(TN_AMX)
    if (!bf16_granted) {
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
        bf16_granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
    }
    return bf16_granted ? 1 : 0;
#elif defined(TN_BF16)
    return 1;  // nothing to grant
#else
    return 0;
#endif
}

// The product engine this build's bf16 kernels use: 1 AMX tiles, 2 AVX512-BF16, 0 none.
int tn_bf16_engine() {
#if defined(TN_AMX)
    return 1;
#elif defined(TN_BF16)
    return 2;
#else
    return 0;
#endif
}

// The kernels' status: 0 ok, 1 bad shape (D, E, c must be multiples of 32), 2 kernels unavailable.
#if defined(TN_BF16)
#define TN_BF16_RUN(c, CALL)                                                                            \
    if (tn_bf16_ready() != 1) return 2;                                                                 \
    if (!shape_ok(B, T, H, D, E, c)) return 1;                                                          \
    const Shape s{B, T, H, D, E, c};                                                                    \
    tn::parallel_ranges(B * H, nthreads, [&](idx lo, idx hi) { Worker(s, lo, hi).CALL; });              \
    return 0
#else
#define TN_BF16_RUN(c, CALL) return 2
#endif

typedef const uint16_t* in_t;  // bf16 tensors as their bits
typedef uint16_t* out_t;

int tn_causal_fwd_bf16(in_t q, in_t k, in_t v, out_t o, const float* init, float* fin, idx B, idx T, idx H, idx D,
                       idx E, idx c, int nthreads) {
    TN_BF16_RUN(c, forward(q, k, v, o, init, fin));
}

int tn_causal_bwd_bf16(in_t q, in_t k, in_t v, in_t dout, const float* init, const float* dfin, out_t dq, out_t dk,
                       out_t dv, float* dinit, idx B, idx T, idx H, idx D, idx E, idx c, int nthreads) {
    TN_BF16_RUN(c, backward(q, k, v, dout, init, dfin, dq, dk, dv, dinit));
}

// Bidirectional form (walked in chunks of kBidirChunk rows).
int tn_bidir_fwd_bf16(in_t q, in_t k, in_t v, out_t o, const float* init, float* fin, idx B, idx T, idx H, idx D,
                      idx E, int nthreads) {
    TN_BF16_RUN(kBidirChunk, bidir_forward(q, k, v, o, init, fin));
}

int tn_bidir_bwd_bf16(in_t q, in_t k, in_t v, in_t dout, const float* S, const float* dfin, out_t dq, out_t dk,
                      out_t dv, float* dinit, idx B, idx T, idx H, idx D, idx E, int nthreads) {
    TN_BF16_RUN(kBidirChunk, bidir_backward(q, k, v, dout, S, dfin, dq, dk, dv, dinit));
}

}  // extern "C"
