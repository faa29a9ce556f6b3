// The small fp32/fp64 GEMM of the fused kernels (_native_linear_attn.cpp: linear attention;
// _native_softmax.cpp: fp32 softmax attention): C[M x N] (= or +=) A B on tiles that stay in
// L1/L2, with a register-blocked micro-kernel on AVX-512 or AVX2+FMA vectors and a portable
// fallback.
#pragma once

#include <algorithm>

#include "_native_common.h"
#include "_native_simd.h"

// The vector width of the micro-kernel: 512 (AVX-512, 32 registers) or 256 (AVX2 with FMA, 16
// registers: e.g. AMD Zen 2/3, Intel before Skylake-X). Without either, plain loops.
#if defined(__AVX512F__)
#define TN_GEMM_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define TN_GEMM_SIMD 256
#endif
#if defined(TN_GEMM_SIMD)
#include <immintrin.h>
#endif

// ---------------------------------------------------------------------------------------------
// Small GEMM: C[M x N] (= or +=) A B with A(m, k) = a[m * ars + k * acs] (so a transposed A is
// just other strides), B row-major (ldb), C row-major (ldc). Operands are tiles of at most a few
// hundred rows; the register-blocked micro-kernel keeps a 6 x 64 (fp32) block of C in registers
// and streams B rows, which stay in L1.
// ---------------------------------------------------------------------------------------------

// Triangular shortcuts for the c x c score tiles of the causal form (they are zero above the
// diagonal, so half their products need not run):
//   kFull      plain product
//   kOutLower  only C(i, j) with j <= i is needed (columns past the row block are skipped;
//              the caller masks the upper triangle afterwards)
//   kALower    A is lower-triangular: row i sums over k <= i only
//   kAUpper    A is upper-triangular: row i sums over k >= i only
enum Tri { kFull = 0, kOutLower = 1, kALower = 2, kAUpper = 3 };

// Whether gemm walks C row block by row block for an A read in rows (acs == 1): where B [K x N]
// stays in L1 across the row blocks (a walk's 64 x 64 state or tile). A larger B (FLASH's chunk
// products on _native_bmm.cpp, 256 x 1024) goes panel by panel, each panel of it kept in cache.
template <typename T>
constexpr bool gemm_rows_outer(idx K, idx N) { return K * N * idx(sizeof(T)) <= 32768; }

#if defined(TN_GEMM_SIMD)
template <typename T> struct Vec;

#if TN_GEMM_SIMD == 512
template <> struct Vec<float> {
    typedef __m512 reg;
    typedef __mmask16 mask;
    static constexpr int W = 16;
    static mask tail(int n) { return mask((1u << n) - 1); }  // lanes [0, n), 1 <= n <= W
    static reg zero() { return _mm512_setzero_ps(); }
    static reg bcast(float x) { return _mm512_set1_ps(x); }
    static reg load(const float* p) { return _mm512_loadu_ps(p); }
    static reg loadm(const float* p, mask m) { return _mm512_maskz_loadu_ps(m, p); }
    static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
    static void stream(float* p, reg r) { _mm512_stream_ps(p, r); }
    static void storem(float* p, reg r, mask m) { _mm512_mask_storeu_ps(p, m, r); }
    static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
    static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
};

template <> struct Vec<double> {
    typedef __m512d reg;
    typedef __mmask8 mask;
    static constexpr int W = 8;
    static mask tail(int n) { return mask((1u << n) - 1); }
    static reg zero() { return _mm512_setzero_pd(); }
    static reg bcast(double x) { return _mm512_set1_pd(x); }
    static reg load(const double* p) { return _mm512_loadu_pd(p); }
    static reg loadm(const double* p, mask m) { return _mm512_maskz_loadu_pd(m, p); }
    static void store(double* p, reg r) { _mm512_storeu_pd(p, r); }
    static void stream(double* p, reg r) { _mm512_stream_pd(p, r); }
    static void storem(double* p, reg r, mask m) { _mm512_mask_storeu_pd(p, m, r); }
    static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_pd(a, b, c); }
    static reg mul(reg a, reg b) { return _mm512_mul_pd(a, b); }
};

constexpr int kMR = 6;  // rows of C per micro-kernel call: 6 x 4 accumulators + 4 B + 1 A = 29 regs
constexpr int kNV = 4;  // vectors of C per row
#else
// AVX2: the masks are vectors (lanes all ones or zero) for vmaskmov, which leaves the other lanes
// of a load zero and those of a store untouched, as AVX-512's masked moves do.
template <> struct Vec<float> {
    typedef __m256 reg;
    typedef __m256i mask;
    static constexpr int W = 8;
    static mask tail(int n) {
        return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    }
    static reg zero() { return _mm256_setzero_ps(); }
    static reg bcast(float x) { return _mm256_set1_ps(x); }
    static reg load(const float* p) { return _mm256_loadu_ps(p); }
    static reg loadm(const float* p, mask m) { return _mm256_maskload_ps(p, m); }
    static void store(float* p, reg r) { _mm256_storeu_ps(p, r); }
    static void stream(float* p, reg r) { _mm256_stream_ps(p, r); }
    static void storem(float* p, reg r, mask m) { _mm256_maskstore_ps(p, m, r); }
    static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
    static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
};

template <> struct Vec<double> {
    typedef __m256d reg;
    typedef __m256i mask;
    static constexpr int W = 4;
    static mask tail(int n) { return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3)); }
    static reg zero() { return _mm256_setzero_pd(); }
    static reg bcast(double x) { return _mm256_set1_pd(x); }
    static reg load(const double* p) { return _mm256_loadu_pd(p); }
    static reg loadm(const double* p, mask m) { return _mm256_maskload_pd(p, m); }
    static void store(double* p, reg r) { _mm256_storeu_pd(p, r); }
    static void stream(double* p, reg r) { _mm256_stream_pd(p, r); }
    static void storem(double* p, reg r, mask m) { _mm256_maskstore_pd(p, m, r); }
    static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_pd(a, b, c); }
    static reg mul(reg a, reg b) { return _mm256_mul_pd(a, b); }
};

constexpr int kMR = 6;  // 6 x 2 accumulators + 2 B + 1 A = 15 of the 16 registers
constexpr int kNV = 2;
#endif

// MASKED: the last vector of each row is a partial one, read and written through `last`. Rows
// that end on a whole vector take plain moves: AVX2's vmaskmov is slow on AMD (Zen 3: the fp32
// fwd+bwd walks, 8 heads of 64, took 3-5% (bidirectional) and 7% (causal) less time without it,
// with the same bits); AVX-512's masked moves cost no more than plain ones.
template <typename T, int MR, int NV, bool MASKED>
static inline void micro(idx K, const T* __restrict a, idx ars, idx acs, const T* __restrict b, idx ldb,
                         const T* c, idx ldc, bool accumulate, typename Vec<T>::mask last, bool stream, T* out,
                         idx ldo) {  // (c and out may be the same tile: not restrict)
    typedef Vec<T> V;
    typename V::reg r[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j)
            r[i][j] = !accumulate ? V::zero()
                      : (MASKED && j == NV - 1 ? V::loadm(c + i * ldc + j * V::W, last) : V::load(c + i * ldc + j * V::W));
    for (idx kk = 0; kk < K; ++kk) {
        typename V::reg bv[NV];
        const T* brow = b + kk * ldb;
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j)
            bv[j] = MASKED && j == NV - 1 ? V::loadm(brow + j * V::W, last) : V::load(brow + j * V::W);
        const T* acol = a + kk * acs;
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            typename V::reg av = V::bcast(acol[i * ars]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) r[i][j] = V::fma(av, bv[j], r[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
            if (stream) V::stream(out + i * ldo + j * V::W, r[i][j]);  // whole 64-byte lines (gemm)
            else if (MASKED && j == NV - 1) V::storem(out + i * ldo + j * V::W, r[i][j], last);
            else V::store(out + i * ldo + j * V::W, r[i][j]);
        }
}

template <typename T, int MR, bool MASKED>
static inline void micro_nv(int nv, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb, const T* c, idx ldc,
                            bool accumulate, typename Vec<T>::mask last, bool stream, T* out, idx ldo) {
#define TN_MICRO(NV) micro<T, MR, NV, MASKED>(K, a, ars, acs, b, ldb, c, ldc, accumulate, last, stream, out, ldo)
    switch (nv) {
        case 1: TN_MICRO(1); break;
        // nv <= kNV (a panel is kNV vectors wide): the min only keeps wider blocks from being built
        case 2: TN_MICRO(std::min(2, kNV)); break;
        case 3: TN_MICRO(std::min(3, kNV)); break;
        default: TN_MICRO(kNV); break;
    }
#undef TN_MICRO
}

template <typename T, int MR>
static inline void micro_rows(int nv, bool masked, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb,
                              const T* c, idx ldc, bool accumulate, typename Vec<T>::mask last, bool stream, T* out,
                              idx ldo) {
    if (masked) micro_nv<T, MR, true>(nv, K, a, ars, acs, b, ldb, c, ldc, accumulate, last, stream, out, ldo);
    else micro_nv<T, MR, false>(nv, K, a, ars, acs, b, ldb, c, ldc, accumulate, last, stream, out, ldo);
}

template <typename T>
static inline void block(idx mr, idx nn, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb, const T* c,
                         idx ldc, bool accumulate, bool stream, T* out, idx ldo) {
    typedef Vec<T> V;
    const int nv = (int)((nn + V::W - 1) / V::W);
    const int tail = (int)(nn - (idx)(nv - 1) * V::W);
    const typename V::mask last = V::tail(tail);
    const bool masked = tail < V::W;
#define TN_ROWS(MR) micro_rows<T, MR>(nv, masked, K, a, ars, acs, b, ldb, c, ldc, accumulate, last, stream, out, ldo)
    switch (mr) {
        case 6: TN_ROWS(6); break;
        case 5: TN_ROWS(5); break;
        case 4: TN_ROWS(4); break;
        case 3: TN_ROWS(3); break;
        case 2: TN_ROWS(2); break;
        default: TN_ROWS(1); break;
    }
#undef TN_ROWS
}

// Columns of C per pass over A: a product with N <= gemm_panel<T>() reads each row of A once.
template <typename T>
constexpr idx gemm_panel() { return kNV * Vec<T>::W; }

// stream: write the result with streaming stores, past the caches (an output not read again
// soon); its rows must be whole 64-byte lines on line boundaries (stream_ok), and tri not
// kOutLower (which leaves blocks unwritten).
// out: where the result goes (ldo apart), when not to C: C then only holds the partial sum
// that accumulate adds to, and a product that completes an output writes it there directly.
template <typename T>
static bool stream_ok(const T* c, idx ldc, idx N) {
    return !((reinterpret_cast<uintptr_t>(c) | uintptr_t(ldc * sizeof(T)) | uintptr_t(N * sizeof(T))) & 63);
}

// C's row blocks: kMR rows each, except that a remainder of 1 to kMR - 2 rows is spread over the
// last two blocks (64 rows: 9 x 6 + 2 x 5, not 10 x 6 + 4). A block of 4 rows keeps only 8 of the
// 12 AVX2 accumulators busy; the 64^3 products of the softmax walk ran 4-6% faster (Zen 3).
struct RowBlocks {
    idx M, n, r;  // rows, blocks, rows past the last whole kMR (0 unless spread)
    explicit RowBlocks(idx M_)
        : M(M_), n((M_ + kMR - 1) / kMR), r(M_ > kMR && M_ % kMR <= kMR - 2 ? M_ % kMR : 0) {}
    idx first(idx b) const { return b * kMR - (r && b == n - 1 ? (kMR - r) / 2 : 0); }
    idx rows(idx b) const {
        if (!r || b < n - 2) return std::min<idx>(kMR, M - b * kMR);
        return b == n - 2 ? (kMR + r + 1) / 2 : (kMR + r) / 2;
    }
};

template <typename T>
static void gemm(idx M, idx N, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb, T* c, idx ldc,
                 bool accumulate, Tri tri = kFull, tn::RowPrefetch* pf = nullptr, bool stream = false,
                 T* out = nullptr, idx ldo = 0) {
    static_assert(kMR == 6, "block() dispatches row counts 1..6");
    if (!out) out = c, ldo = ldc;
    const idx panel = gemm_panel<T>();
    const RowBlocks rb(M);
    const idx mblocks = rb.n, panels = (N + panel - 1) / panel, blocks = mblocks * panels;
    // An A read in rows against a small B (gemm_rows_outer): row block by row block, each row
    // block of A used for all the panels in turn while its lines are in L1, so A can be read in
    // place from rows far apart (a head's rows of [B, T, H, D]: 2 KB apart, sharing a few L1 sets)
    // even where C is several panels wide (the 16-column panels of AVX2). Otherwise panel by
    // panel, B's panel staying in cache across the row blocks.
    const bool rows_outer = acs == 1 && gemm_rows_outer<T>(K, N);
    for (idx done = 0; done < blocks;) {
        const idx mb = rows_outer ? done / panels : done % mblocks, m0 = rb.first(mb), mr = rb.rows(mb);
        const idx n0 = (rows_outer ? done % panels : done / mblocks) * panel;
        ++done;
        if (pf) pf->share(done, blocks);
        idx nn = std::min(panel, N - n0), k0 = 0, k1 = K;
        if (tri == kOutLower) {
            if (n0 >= m0 + mr) continue;
            nn = std::min(nn, m0 + mr - n0);
        } else if (tri == kALower) {
            k1 = std::min(K, m0 + mr);
        } else if (tri == kAUpper) {
            k0 = std::min(K, m0);
        }
        const T* cb = c + m0 * ldc + n0;
        T* ob = out + m0 * ldo + n0;
        if (k1 <= k0) {  // no terms: C as it was, or zeros
            for (idx i = 0; i < mr; ++i)
                if (!accumulate) std::fill(ob + i * ldo, ob + i * ldo + nn, T(0));
                else if (ob != cb) std::copy(cb + i * ldc, cb + i * ldc + nn, ob + i * ldo);
            continue;
        }
        block<T>(mr, nn, k1 - k0, a + m0 * ars + k0 * acs, ars, acs, b + k0 * ldb + n0, ldb, cb, ldc, accumulate,
                 stream, ob, ldo);
    }
    if (pf) pf->issue(pf->rows);
}
#else
// Portable fallback (neither AVX-512 nor AVX2+FMA): plain loops the compiler vectorises along n.
constexpr int kMR = 6;  // rows per band of tn_bmm's split over threads

template <typename T>
static bool stream_ok(const T*, idx, idx) { return false; }
template <typename T>
constexpr idx gemm_panel() { return idx(1) << 40; }  // each row of A is read once, for all of C's row

template <typename T>
static void gemm(idx M, idx N, idx K, const T* a, idx ars, idx acs, const T* b, idx ldb, T* c, idx ldc,
                 bool accumulate, Tri = kFull, tn::RowPrefetch* = nullptr, bool = false, T* out = nullptr,
                 idx ldo = 0) {  // full products: the masked tiles are zero anyway
    if (!out) out = c, ldo = ldc;
    for (idx m = 0; m < M; ++m) {
        T* crow = out + m * ldo;
        if (!accumulate) std::fill(crow, crow + N, T(0));
        else if (out != c) std::copy(c + m * ldc, c + m * ldc + N, crow);
        for (idx kk = 0; kk < K; ++kk) {
            const T av = a[m * ars + kk * acs];
            const T* brow = b + kk * ldb;
            for (idx n = 0; n < N; ++n) crow[n] += av * brow[n];
        }
    }
}
#endif
