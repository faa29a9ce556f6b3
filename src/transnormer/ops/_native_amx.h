// AMX tile helpers shared by the bf16 kernels (_native_amx.cpp: linear attention;
// _native_softmax_amx.cpp: softmax attention): the tile configuration, the product C (+)= A B
// on 32 x 32 blocks of C, and the packs into the operand layouts.
//
// AMX basics. A tile is up to 16 rows of 64 bytes. TDPBF16PS C += A B takes A as 16 rows of 32
// bf16 (row-major, the reduction along the row) and B in "VNNI" form: 16 rows, row r holding
// the pairs (B[2r][n], B[2r+1][n]) for n = 0..15 as 32-bit words. So B operands are repacked:
// a row-major X becomes VNNI(X) by interleaving row pairs, and VNNI(X^T) is simply the 32-bit
// transpose of X (its bf16 pairs are already the pairs needed). TN_AMX is defined when the
// build has AMX; Linux must also grant the process the tile state (tn_amx_ready).
#pragma once

#include "_native_common.h"
#include "_native_simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(TN_AVX512)
#define TN_AMX 1

extern "C" int tn_amx_ready();

namespace tn_amx {

typedef uint16_t bf;  // bf16 bits
typedef uint32_t w32;  // a pair of bf16

// ---------------------------------------------------------------------------------------------
// Tiles and the product
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

// Which blocks of C are needed: a c x c score tile is triangular, and blocks wholly above
// (kLowerC) or below (kUpperC) its diagonal are skipped, left unset for the masked conversion
// after the product to zero.
enum Out { kAll, kLowerC, kUpperC };

// C [M x N] fp32 (row stride ldc) = or += the sum of np products A_i B_i: the sum runs in the
// tiles, so C is loaded and stored once. M, N and each K multiples of 32.
inline void gemm_sum(idx M, idx N, const Pair* ps, int np, float* C, idx ldc, bool accumulate, Out out = kAll) {
    for (idx m0 = 0; m0 < M; m0 += 32)
        for (idx n0 = 0; n0 < N; n0 += 32) {
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
}

// C = or += A1 B1 (+ A2 B2)
inline void gemm(idx M, idx N, const Pair& p1, const Pair* p2, float* C, idx ldc, bool accumulate, Out out = kAll) {
    const Pair ps[2] = {p1, p2 ? *p2 : p1};
    gemm_sum(M, N, ps, p2 ? 2 : 1, C, ldc, accumulate, out);
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

using tn::to_bf16;  // one instruction here: AMX comes with AVX512-BF16

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

}  // namespace tn_amx
#endif  // TN_AMX
