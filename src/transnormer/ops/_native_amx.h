// bf16 product helpers shared by the bf16 kernels (_native_amx.cpp: linear attention;
// _native_softmax_amx.cpp: softmax attention): the product C (+)= A B (M, N and K multiples of
// 32; triangular A or C cut by blocks), and the packs into the operand layouts. The product runs
// on one of two engines, chosen when the library is built (-march=native):
//   AMX tiles (TN_AMX; Intel Sapphire Rapids and later): TDPBF16PS on 16 x 16 tiles;
//   AVX512-BF16 (TN_BF16 without TN_AMX; e.g. AMD Zen 4/5): VDPBF16PS on 16-lane vectors.
// Both take the same operand layouts and give the same sums up to the order of the fp32 adds,
// so the kernels above them are written once.
//
// The layouts are AMX's. A tile is up to 16 rows of 64 bytes. TDPBF16PS C += A B takes A as 16
// rows of 32 bf16 (row-major, the reduction along the row) and B in "VNNI" form: 16 rows, row r
// holding the pairs (B[2r][n], B[2r+1][n]) for n = 0..15 as 32-bit words (VDPBF16PS takes the
// same words: lane n gets B[2r][n] A[m][2r] + B[2r+1][n] A[m][2r+1]). So B operands are repacked:
// a row-major X becomes VNNI(X) by interleaving row pairs, and VNNI(X^T) is simply the 32-bit
// transpose of X (its bf16 pairs are already the pairs needed). With AMX, Linux must also grant
// the process the tile state (tn_bf16_ready).
#pragma once

#include <cstring>
#include <type_traits>

#include "_native_common.h"
#include "_native_simd.h"

#if defined(__AVX512BF16__) && defined(TN_AVX512)
#define TN_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TN_AMX 1
#endif

extern "C" int tn_bf16_ready();

namespace tn_amx {

typedef uint16_t bf;  // bf16 bits
typedef uint32_t w32;  // a pair of bf16

// One operand pair of a product: A [M x K] row-major bf16 (row stride lda) and B given as
// VNNI(B) [K/2 x N] words (row stride ldb). A may be triangular (a c x c score tile), so that
// row block m sums over k <= m (kLowerA) or k >= m (kUpperA) only.
enum Tri { kDense, kLowerA, kUpperA };
struct Pair {
    idx K;
    const bf* A;
    idx lda;
    const w32* B;
    idx ldb;
    Tri shape;
};

// The same with A given in pairs, AVX512-BF16 engine only: A as VNNI(A^T) [K/2 x M] words (row
// stride lda words), the word (k/2, m) holding A[m][k], A[m][k+1]. For A = X^T of a chunk's
// rows X [K x M] that is VNNI(X), one interleaving pass, where the row-major X^T takes a
// transpose (the 32-bit transpose with its words split: transpose_rows); dense A only.
struct PairsA {
    idx K;
    const w32* A;
    idx lda;
    const w32* B;
    idx ldb;
};

// Which blocks of C are needed: a c x c score tile is triangular, and blocks wholly above
// (kLowerC) or below (kUpperC) its diagonal are skipped, left unset for the masked conversion
// after the product to zero.
enum Out { kAll, kLowerC, kUpperC };

#if defined(TN_AMX)
// ---------------------------------------------------------------------------------------------
// Engine 1: AMX tiles
// ---------------------------------------------------------------------------------------------

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Eight 16 x 64-byte tiles: 0-3 accumulate a 32 x 32 fp32 block of C, 4-5 hold two 16-row A
// panels, 6-7 two 16-column B panels. The configuration is per thread. It is a constant in
// memory: GCC 12 treats LDTILECFG's operand as unread and drops stores to a local config.
inline const TileConfig kTiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void configure_tiles() { _tile_loadconfig(&kTiles); }
inline void release_tiles() { _tile_release(); }

inline void pair_step(const Pair& p, idx m0, idx n0, idx k) {
    _tile_loadd(4, p.A + m0 * p.lda + k, p.lda * 2);
    _tile_loadd(6, p.B + (k / 2) * p.ldb + n0, p.ldb * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, p.B + (k / 2) * p.ldb + n0 + 16, p.ldb * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, p.A + (m0 + 16) * p.lda + k, p.lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

inline void pair_sum(const Pair& p, idx m0, idx n0) {
    const idx k0 = p.shape == kUpperA ? m0 : 0, k1 = p.shape == kLowerA ? std::min(p.K, m0 + 32) : p.K;
    for (idx k = k0; k < k1; k += 32) pair_step(p, m0, n0, k);
}

// C [M x N] fp32 (row stride ldc) = or += the sum of np products A_i B_i: the sum runs in the
// tiles, so C is loaded and stored once. M, N and each K multiples of 32.
inline void gemm_sum(idx M, idx N, const Pair* ps, int np, float* C, idx ldc, bool accumulate, Out out = kAll,
                     tn::RowPrefetch* pf = nullptr) {
    const idx blocks = ((M + 31) / 32) * ((N + 31) / 32);
    idx done = 0;
    for (idx m0 = 0; m0 < M; m0 += 32)
        for (idx n0 = 0; n0 < N; n0 += 32) {
            if (pf) pf->share(++done, blocks);
            if ((out == kLowerC && n0 > m0) || (out == kUpperC && n0 < m0)) continue;
            float* c = C + m0 * ldc + n0;
            const idx cs = ldc * 4;
            if (accumulate) {
                _tile_loadd(0, c, cs);
                _tile_loadd(1, c + 16, cs);
                _tile_loadd(2, c + 16 * ldc, cs);
                _tile_loadd(3, c + 16 * ldc + 16, cs);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int i = 0; i < np; ++i) pair_sum(ps[i], m0, n0);
            _tile_stored(0, c, cs);
            _tile_stored(1, c + 16, cs);
            _tile_stored(2, c + 16 * ldc, cs);
            _tile_stored(3, c + 16 * ldc + 16, cs);
        }
    if (pf) pf->issue(pf->rows);
}
#else
// ---------------------------------------------------------------------------------------------
// Engine 2: AVX512-BF16 dot products
// ---------------------------------------------------------------------------------------------
// C is walked in blocks of 8 rows x 32 columns held in 16 accumulators (VDPBF16PS has a
// latency of several cycles, and Zen 5 issues two a cycle: 16 independent sums keep it busy;
// a 64^3 product in L1 runs at 455-478 GFLOP/s on one core, the peak); per pair
// of k, one B row (2 vectors, in L1) and 8 broadcast A words. Triangular A and C are cut at
// 8-row granularity, finer than the tiles' 32: the skipped A entries and C blocks are zero or
// masked by the callers either way.

inline void configure_tiles() {}
inline void release_tiles() {}

constexpr idx kDpRows = 8;

inline __m512bh a_pair(const bf* p) {  // the bf16 pair at p, in every lane
    int32_t w;
    std::memcpy(&w, p, sizeof(w));
    return (__m512bh)_mm512_set1_epi32(w);
}

// acc[8 x 32] += A rows [m0, m0 + 8) x B columns [n0, n0 + 32), over k in [k0, k1) (even).
inline void dp_rows(const Pair& p, idx m0, idx n0, idx k0, idx k1, __m512 (&acc)[kDpRows][2]) {
    const bf* a = p.A + m0 * p.lda;
    for (idx k = k0; k < k1; k += 2) {
        const w32* b = p.B + (k / 2) * p.ldb + n0;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#pragma GCC unroll 8
        for (idx i = 0; i < kDpRows; ++i) {
            const __m512bh ai = a_pair(a + i * p.lda + k);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
}

// acc[8 x 32] += the same block of an A given in pairs (PairsA), over all of K.
inline void dp_rows(const PairsA& p, idx m0, idx n0, __m512 (&acc)[kDpRows][2]) {
    for (idx k2 = 0; k2 < p.K / 2; ++k2) {
        const w32* b = p.B + k2 * p.ldb + n0;
        const w32* a = p.A + k2 * p.lda + m0;  // the 8 rows' words are adjacent
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
#pragma GCC unroll 8
        for (idx i = 0; i < kDpRows; ++i) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32(int32_t(a[i]));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
}

// Where gemm_sum may write its result instead of C: rows [0, rows) of a bf16 output (row stride
// ld, rows on 64-byte lines), rounded as to_bf16 rounds and written with streaming stores, past
// the caches. Each block's 32 columns are one line.
struct Bf16Rows {
    bf* p;
    idx ld, rows;
};

// C [M x N] fp32 (row stride ldc) = or += the sum of np products A_i B_i (M, N and each K
// multiples of 32; the same contract as the AMX engine's). P: Pair or PairsA (dense). With
// `to` (not accumulating, all of C), the sum goes to that bf16 output instead of C.
template <typename P>
inline void gemm_sum(idx M, idx N, const P* ps, int np, float* C, idx ldc, bool accumulate, Out out = kAll,
                     tn::RowPrefetch* pf = nullptr, const Bf16Rows* to = nullptr) {
    const idx blocks = ((N + 31) / 32) * ((M + kDpRows - 1) / kDpRows);
    idx done = 0;
    for (idx n0 = 0; n0 < N; n0 += 32)
        for (idx m0 = 0; m0 < M; m0 += kDpRows) {
            if (pf) pf->share(++done, blocks);
            if ((out == kLowerC && n0 > m0 + kDpRows - 1) || (out == kUpperC && n0 + 31 < m0)) continue;
            float* c = to ? nullptr : C + m0 * ldc + n0;  // (C is null when writing to `to`)
            __m512 acc[kDpRows][2];
#pragma GCC unroll 8
            for (idx i = 0; i < kDpRows; ++i) {
                acc[i][0] = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
                acc[i][1] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
            }
            for (int j = 0; j < np; ++j) {
                if constexpr (std::is_same_v<P, PairsA>) {
                    dp_rows(ps[j], m0, n0, acc);
                } else {
                    const Pair& p = ps[j];
                    const idx k0 = p.shape == kUpperA ? m0 : 0;
                    const idx k1 = p.shape == kLowerA ? std::min(p.K, m0 + kDpRows) : p.K;
                    dp_rows(p, m0, n0, k0, k1, acc);
                }
            }
            if (to) {  // (a fixed trip count, unrolled: indexed by a variable, acc would live in memory)
#pragma GCC unroll 8
                for (idx i = 0; i < kDpRows; ++i)
                    if (m0 + i < to->rows)
                        _mm512_stream_si512(reinterpret_cast<__m512i*>(to->p + (m0 + i) * to->ld + n0),
                                            (__m512i)_mm512_cvtne2ps_pbh(acc[i][1], acc[i][0]));
                continue;
            }
#pragma GCC unroll 8
            for (idx i = 0; i < kDpRows; ++i) {
                _mm512_storeu_ps(c + i * ldc, acc[i][0]);
                _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
            }
        }
    if (pf) pf->issue(pf->rows);
}
#endif  // engines

// C = or += A1 B1 (+ A2 B2); pf: rows to fetch as the product runs (tn::RowPrefetch)
inline void gemm(idx M, idx N, const Pair& p1, const Pair* p2, float* C, idx ldc, bool accumulate, Out out = kAll,
                 tn::RowPrefetch* pf = nullptr) {
    const Pair ps[2] = {p1, p2 ? *p2 : p1};
    gemm_sum(M, N, ps, p2 ? 2 : 1, C, ldc, accumulate, out, pf);
}

// ---------------------------------------------------------------------------------------------
// Packing (all widths multiples of 32 bf16 / 16 words)
// ---------------------------------------------------------------------------------------------

// dst [R x C] contiguous = the first L rows of src (row stride lds), rows L..R-1 zero.
inline void pack(idx L, idx R, idx C, const bf* src, idx lds, bf* dst) {
    for (idx r = 0; r < R; ++r)
        for (idx j = 0; j < C; j += 32) {
            const __m512i x = r < L ? _mm512_loadu_si512(src + r * lds + j) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + r * C + j, x);
        }
}

// VNNI(X^T) [C/2 x R] words from X [R x C] bf16 (row stride ldx): the 32-bit transpose.
inline void vnni_of_transpose(idx R, idx C, const bf* x, idx ldx, w32* dst) {
    const idx C2 = C / 2;
    const float* s = reinterpret_cast<const float*>(x);
    float* d = reinterpret_cast<float*>(dst);
    for (idx r0 = 0; r0 < R; r0 += 16)
        for (idx c0 = 0; c0 < C2; c0 += 16) tn::transpose16(s + r0 * (ldx / 2) + c0, ldx / 2, d + c0 * R + r0, R);
}

// VNNI(X) [R/2 x C] words from X [R x C] bf16 (row stride ldx): rows 2i and 2i+1 interleaved.
inline void vnni(idx R, idx C, const bf* x, idx ldx, w32* dst) {
    alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    for (idx r = 0; r < R; r += 2)
        for (idx j = 0; j < C; j += 32) {
            const __m512i a = _mm512_loadu_si512(x + r * ldx + j), b = _mm512_loadu_si512(x + (r + 1) * ldx + j);
            w32* out = dst + (r / 2) * C + j;
            _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
}

// X^T [C x R] bf16 row-major from X [R x C] bf16 (row stride ldx), as vnni_of_transpose then
// unpair give it, in one pass: the 32-bit transpose, each of its word rows split into two bf16
// rows as it leaves the registers (a byte shuffle gathers each 128-bit lane's low and high
// halves, a qword permute the lanes'). A 32 x 64 block in L1: 93 ns, against 125-130 for the
// two passes. (A 16-bit butterfly on two-source word permutes took 220 ns.)
inline void transpose_rows(idx R, idx C, const bf* x, idx ldx, bf* dst) {
    const __m512i halves = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i lanes = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    const float* s = reinterpret_cast<const float*>(x);
    for (idx r0 = 0; r0 < R; r0 += 16)
        for (idx c0 = 0; c0 < C / 2; c0 += 16)
            tn::transpose16_with(s + r0 * (ldx / 2) + c0, ldx / 2, [&](int j, __m512 pairs) {
                // pairs: X[r0 + i][2 (c0 + j)], X[r0 + i][2 (c0 + j) + 1] for i = 0..15
                const __m512i v = _mm512_permutexvar_epi64(lanes, _mm512_shuffle_epi8(_mm512_castps_si512(pairs), halves));
                bf* row = dst + 2 * (c0 + j) * R + r0;
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_castsi512_si256(v));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + R), _mm512_extracti64x4_epi64(v, 1));
            });
}

// X^T [C x R] bf16 row-major from VNNI(X^T) [C/2 x R] words: each word row splits into two rows.
inline void unpair(idx C2, idx R, const w32* v, bf* dst) {
    for (idx i = 0; i < C2; ++i)
        for (idx j = 0; j < R; j += 16) {
            const __m512i w = _mm512_loadu_si512(v + i * R + j);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i * R + j), _mm512_cvtepi32_epi16(w));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * i + 1) * R + j),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
        }
}

enum Mask { kNone, kLower, kUpper };  // keep j <= i / j >= i

using tn::to_bf16;  // one instruction here (AVX512-BF16)

// dst [R x C] bf16 (row stride ldd) = src [R x C] fp32 (lds), rounded, optionally masked to a triangle.
inline void to_bf16_rows(idx R, idx C, const float* src, idx lds, bf* dst, idx ldd, Mask mask = kNone) {
    for (idx i = 0; i < R; ++i)
        for (idx j = 0; j < C; j += 16) {
            __mmask16 keep = 0xFFFF;
            if (mask == kLower) keep = j > i ? 0 : (i - j >= 15 ? 0xFFFF : __mmask16((1u << (i - j + 1)) - 1));
            else if (mask == kUpper) keep = j + 15 < i ? 0 : (i <= j ? 0xFFFF : __mmask16(0xFFFFu << (i - j)));
            const __m512 x = _mm512_maskz_loadu_ps(keep, src + i * lds + j);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * ldd + j), to_bf16(x));
        }
}

// The same without a mask, for results written to the output tensors: streaming stores when
// the rows are 64-byte aligned, so lines are not read from memory only to be overwritten (at
// long T the op is bound by memory traffic, a third of it those reads). Needs an sfence before
// the results are read (end of the walk).
inline void stream_bf16_rows(idx R, idx C, const float* src, idx lds, bf* dst, idx ldd) {
    if ((reinterpret_cast<uintptr_t>(dst) | uintptr_t(ldd * 2)) & 63) return to_bf16_rows(R, C, src, lds, dst, ldd);
    for (idx i = 0; i < R; ++i)
        for (idx j = 0; j < C; j += 32) {
            const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i * lds + j + 16), _mm512_loadu_ps(src + i * lds + j));
            _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i * ldd + j), (__m512i)x);
        }
}

// A1 B1 (+ A2 B2) rounded into the first `rows` rows of the bf16 output `dst` (row stride ld).
// On the dot-product engine, where the rows are on 64-byte lines, straight from the
// accumulators with streaming stores; else through the fp32 tile `tile` (ld N) and one
// conversion pass. fwd+bwd, 8 heads of 64, medians of 21 (causal 15) interleaved in one process,
// two runs on a loaded machine: bidirectional 3.19 -> 2.94 and 4.69 -> 4.21 ms at 4k, 16.0 ->
// 13.3 and 18.8 -> 17.0 at 16k; causal within noise (7.08 -> 7.26, 5.57 -> 5.35 at 4k). (A
// first version bounded the store loop by the rows left: acc, indexed by a variable, then lived
// in memory and the walks ran twice as long.)
inline void gemm_to_rows(idx M, idx N, const Pair& p1, const Pair* p2, idx rows, bf* dst, idx ld, float* tile,
                         tn::RowPrefetch* pf = nullptr) {
#if !defined(TN_AMX)
    if (!((reinterpret_cast<uintptr_t>(dst) | uintptr_t(ld * 2)) & 63)) {
        const Pair ps[2] = {p1, p2 ? *p2 : p1};
        const Bf16Rows to{dst, ld, rows};
        gemm_sum(M, N, ps, p2 ? 2 : 1, nullptr, 0, false, kAll, pf, &to);
        return;
    }
#endif
    gemm(M, N, p1, p2, tile, N, false, kAll, pf);
    stream_bf16_rows(rows, N, tile, N, dst, ld);
}

}  // namespace tn_amx
#endif  // TN_BF16
