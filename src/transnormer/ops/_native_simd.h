// AVX-512 helpers shared by the fused CPU kernels: 16-lane fp32 loads/stores from fp32 or bf16
// storage, and exp. TN_AVX512 is defined when F (arithmetic), BW and VL (16-bit masked
// loads/stores of bf16) are all available; the kernels keep portable loops otherwise.
#pragma once

#include "_native_common.h"

namespace tn {

// Query lanes of the softmax-attention kernels (queries along the vector lanes, one bit each).
typedef uint64_t Lanes;  // one bit per query of a block

inline Lanes lane_range(idx from, idx to) {  // lanes [max(from, 0), min(to, 64))
    from = std::max<idx>(from, 0), to = std::min<idx>(to, 64);
    if (from >= to) return 0;
    return (to == 64 ? ~Lanes(0) : (Lanes(1) << to) - 1) & ~((Lanes(1) << from) - 1);
}

}  // namespace tn

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TN_AVX512 1
#include <immintrin.h>

namespace tn {

// ln(2)^k / k!: the Taylor coefficients of 2^f, f near 0 (the exp2 forms below)
constexpr float kExp2Taylor[8] = {1.0f, 0.69314718f, 0.24022651f, 5.5504109e-2f, 9.6181291e-3f, 1.3333558e-3f,
                                  1.5403530e-4f, 1.5252734e-5f};

// lanes [0, min(left, 16)) of a 16-lane vector
inline __mmask16 tail_mask(long left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
// fp32 -> bf16, round to nearest even, a NaN stays a quiet NaN. With AVX512-BF16 one instruction
// (vcvtneps2bf16, which rounds as PyTorch does except that it reads fp32 subnormals, |x| < 1.2e-38,
// as zero, as AMX's bf16 products do); without it the rounding is done on the bits. The row kernels
// are bound by their instruction count, and this was ~8 of the ~55 per vector of the SiLU gate's
// backward: 17% of those kernels' time.
#if defined(__AVX512BF16__)
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
inline __m256i to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    return _mm512_cvtepi32_epi16(r);
}
#endif
inline void store16(bf16* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(x)); }

// x rounded as store16 rounds it, held in fp32 (the low 16 bits zero), so that one rounded value
// can be stored in more than one layout
inline __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
// x rounded to the storage type of the pointer's pointee (fp32: unchanged)
inline __m512 round_to(const float*, __m512 x) { return x; }
inline __m512 round_to(const bf16*, __m512 x) { return round_bf16(x); }

// stores of values already representable in the storage type (read back from it): no rounding
inline void store16_rounded(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16_rounded(bf16* p, __m512 x, __mmask16 m) {  // the top halves: exact for such values
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

// exp(x) for x <= 0 (a row minus its max): x = n ln2 + r, |r| <= ln2/2, e^r by its degree-7
// Taylor polynomial (truncation < 6e-9 relative), times 2^n by scalef (underflows to 0 cleanly).
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// e^x - 1 for x <= 0 (expm1_nonpositive in _native_common.h): where n = 0, r times the
// polynomial without its leading 1, so small |x| keep their relative precision
inline __m512 expm1_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 q = _mm512_set1_ps(1.0f / 5040.0f);
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 720.0f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 120.0f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 24.0f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 6.0f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
    const __m512 rq = _mm512_mul_ps(r, q), one = _mm512_set1_ps(1.0f);
    const __m512 far = _mm512_sub_ps(_mm512_scalef_ps(_mm512_add_ps(rq, one), n), one);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_EQ_OQ), far, rq);
}

inline __mmask16 half(Lanes v, int h) { return __mmask16(v >> (16 * h)); }

// 2^f for |f| <= 1/2 by its Taylor polynomial of degree Deg (the two exp2 forms below share it).
template <int Deg>
inline __m512 exp2_frac(__m512 f) {
    __m512 p = _mm512_set1_ps(kExp2Taylor[Deg]);
    for (int k = Deg - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[k]));
    return p;
}

// 2^x, x finite (a scaled score less its row max, or less its log-sum): 2^x = 2^n 2^f,
// |f| <= 1/2, 2^f by its Taylor polynomial of degree Deg, scalef underflowing to 0 cleanly; masked
// lanes 0. Relative error: < 4e-6 at degree 5 (the bf16 kernel: its operands P, dS round at
// 4e-3), < 1e-8 at 7.
template <int Deg = 5>
inline __m512 exp2_masked(__mmask16 keep, __m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    const __m512 p = exp2_frac<Deg>(f);
    return _mm512_maskz_scalef_ps(keep, p, n);
}

// exp2_masked's values where x > -125, the scaling done on the exponent bits: n = round(x) by the
// 1.5 * 2^23 shifter (exact, ties to even as VRNDSCALEPS), 2^n added to the exponent field.
// Masked lanes and x <= -125 give 0 (results at or below 2^-125 flush: beside a softmax row's
// largest term, ~1, they are below fp32's resolution); a NaN stays NaN; x is taken as at most 127.
// The shifter needs IEEE arithmetic as written (no -ffast-math, which may fold (x + s) - s).
// The bf16 softmax backward uses it: with exp2_masked it ran 40% slower on Zen 5 (162 vs 116 ms,
// T = 4k, one thread), though each instruction alone runs as fast there (the cause is not known:
// no hardware counters on that machine). The bf16 forward ran 7% faster with exp2_masked (47.5 vs
// 51 ms) and the fp32 backward as fast (51 vs 52 ms at 2k), so they keep it.
template <int Deg = 5>
inline __m512 exp2_bits(__mmask16 keep, __m512 x) {
    const __m512 shifter = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23: x + it rounds x to an integer
    const __mmask16 flush = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_LE_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-125.0f)), _mm512_set1_ps(127.0f));
    const __m512 t = _mm512_add_ps(xc, shifter);  // its low mantissa bits hold n (two's complement)
    const __m512 f = _mm512_sub_ps(xc, _mm512_sub_ps(t, shifter));
    const __m512 p = exp2_frac<Deg>(f);
    const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(t), 23);  // n << 23, wrapping as n's sign needs
    const __m512 r = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(keep & ~flush, r), keep & nan, x);
}

// The online softmax's rescale factor where a lane's running max of raw scores rose from m_old
// to m_new: 2^((m_old - m_new) c), c = scale log2(e), formed from the difference of the raw maxima
// as the step's p = 2^((s - m_new) c) are (the scaled maxima themselves round to a multiple of
// their ulp, which at |m c| > 2^31 is more than the exponent range); exactly 1 where the max did
// not move, 0 from m_old = -inf. moved: the lanes where the max rose.
inline __m512 online_rescale(__m512 m_old, __m512 m_new, __m512 c, __mmask16& moved) {
    moved = _mm512_cmp_ps_mask(m_new, m_old, _CMP_GT_OQ);
    const __m512 x = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), c), _mm512_set1_ps(-1000.0f));
    return _mm512_mask_blend_ps(moved, _mm512_set1_ps(1.0f), exp2_masked<7>(moved, x));
}

}  // namespace tn
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tn {

// 16 x 16 blocks of 32-bit elements (fp32, or bf16 pairs) transposed in registers (unpack 32-bit, unpack 64-bit, then two rounds of
// 128-bit lane shuffles); a scalar loop takes the ragged edges. (A scalar 64 x 64 transpose of
// a hot tile took ~1 us, 40% of a 64^3 product.)
// store(j, row j of the transposed block) takes the rows as they leave the registers.
template <typename Store>
inline void transpose16_with(const float* src, idx ld_s, Store store) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_s);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 interleaved: 4-element columns per lane
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; ++j) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 8; ++j) {
        store(j, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
        store(j + 8, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
    }
}

inline void transpose16(const float* src, idx ld_s, float* dst, idx ld_d) {
    transpose16_with(src, ld_s, [&](int j, __m512 row) { _mm512_storeu_ps(dst + j * ld_d, row); });
}

}  // namespace tn
#endif

#if defined(TN_AVX512)
namespace tn {

// The first nr <= 64 / sizeof(Td) rows of src (rows lds apart, w columns) stored transposed in Td
// (rounded once where Td is narrower): column c at dst + c * ldt. Blocks of 64 bytes of dst (16
// fp32 or 32 bf16 rows) are written as whole cache lines, streamed past the cache when aligned:
// dst's rows are a multiple of 4 KB apart at the usual lengths, so cached partial-line stores all
// fall in one L1 set, and the copy is read only by a later product. The caller ends its stores
// with _mm_sfence().
template <typename Ts, typename Td>
inline void transpose_rows(const Ts* src, idx lds, idx nr, idx w, Td* dst, idx ldt) {
    constexpr idx kRows = 64 / sizeof(Td);
    alignas(64) float blk[16][16], lo[16][16], hi[16][16];
    for (idx j = 0; j < w; j += 16) {
        const __mmask16 k = tail_mask(w - j);
        for (idx h = 0; h < kRows; h += 16) {
            for (idx i = 0; i < 16; ++i)
                _mm512_store_ps(blk[i], h + i < nr ? round_to(dst, load16(src + (h + i) * lds + j, k))
                                                   : _mm512_setzero_ps());
            transpose16(&blk[0][0], 16, h ? &hi[0][0] : &lo[0][0], 16);
        }
        for (idx c = 0; c < std::min<idx>(16, w - j); ++c) {
            Td* d = dst + (j + c) * ldt;
            const bool line = nr == kRows && (reinterpret_cast<uintptr_t>(d) & 63) == 0;
            if constexpr (sizeof(Td) == 4) {
                const __m512 v = _mm512_load_ps(lo[c]);
                if (line)
                    _mm512_stream_ps(reinterpret_cast<float*>(d), v);
                else
                    store16_rounded(d, v, tail_mask(nr));
            } else {  // the top halves of 32 fp32 lanes: 32 bf16
                const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31,
                                                     29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
                const __m512i v = _mm512_permutex2var_epi16(_mm512_castps_si512(_mm512_load_ps(lo[c])), odd,
                                                            _mm512_castps_si512(_mm512_load_ps(hi[c])));
                if (line)
                    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), v);
                else
                    _mm512_mask_storeu_epi16(d, nr >= 32 ? ~__mmask32(0) : (__mmask32(1) << nr) - 1u, v);
            }
        }
    }
}

}  // namespace tn
#endif

#if !defined(TN_AVX512) && defined(__AVX2__)
#include <immintrin.h>

namespace tn {

// 8 x 8 fp32 in registers: r[i] holds row i on entry and column i on exit (unpack 32-bit pairs,
// shuffle 64-bit pairs, then swap 128-bit halves)
inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // rows 4i..4i+3: s[4i + c] = column c | column c + 4
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; ++c) {
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
}

#if defined(__FMA__)
#define TN_AVX2_FMA 1  // the fp32 softmax kernel's AVX2 form (_native_softmax.cpp)

// The eight lanes of vector h of a 64-lane block of Lanes as a vector mask (all ones or zero)
inline __m256 lane_mask8(Lanes v, int h) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(int((v >> (8 * h)) & 0xFF)), bit);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
}

// 2^f for |f| <= 1/2 to 3e-9 relative: the degree-6 polynomial of least maximum relative error,
// its coefficients rounded to fp32 one at a time from c1 up, each refit the rest (Lawson's
// iteration on 40001 points). Evaluated in fp32 it is within 6.4e-8 of 2^f, as the degree-7
// Taylor polynomial of the AVX-512 forms is (7.0e-8), for one FMA less.
constexpr float kExp2Minimax6[7] = {1.0f, 0.693147182f, 0.240226477f, 0.0555035993f, 0.00961850584f,
                                    0.00133908063f, 0.000153264744f};

// 2^x on eight lanes (AVX2 has no scalef): 2^x = 2^n 2^f, n = round(x) (ties to even) read from
// the low mantissa bits of x + 1.5 * 2^23 + 127, which also hold the exponent field of 2^n; the
// product p 2^n keeps a NaN that p carries. Lanes outside keep (a vector mask) and x <= -125
// (-inf too) give 0, whatever the arithmetic made of them; x is taken as at most 127. Needs IEEE
// arithmetic as written (no -ffast-math).
inline __m256 exp2_8(__m256 keep, __m256 x) {
    const __m256 shifter = _mm256_set1_ps(12582912.0f + 127.0f);
    const __m256 live = _mm256_and_ps(keep, _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_NLE_UQ));  // NaN: live
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(127.0f), x);  // (min's second operand: a NaN x stays)
    const __m256 t = _mm256_add_ps(xc, shifter);
    const __m256 f = _mm256_sub_ps(xc, _mm256_sub_ps(t, shifter));
    __m256 p = _mm256_set1_ps(kExp2Minimax6[6]);
    for (int k = 5; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Minimax6[k]));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));  // 2^n
    return _mm256_and_ps(live, _mm256_mul_ps(p, scale));
}

// online_rescale (the AVX-512 section) on eight lanes; moved: whether any lane's max rose. No clamp
// of the exponent: exp2_8 gives 0 at -inf (m_old = -inf), where exp2_masked gives NaN.
inline __m256 online_rescale8(__m256 m_old, __m256 m_new, __m256 c, bool& moved) {
    const __m256 rose = _mm256_cmp_ps(m_new, m_old, _CMP_GT_OQ);
    moved = _mm256_movemask_ps(rose) != 0;
    const __m256 x = _mm256_mul_ps(_mm256_sub_ps(m_old, m_new), c);
    return _mm256_blendv_ps(_mm256_set1_ps(1.0f), exp2_8(rose, x), rose);
}
#endif  // __FMA__

// transpose_rows (above) for fp32 on AVX2: nr <= 16 rows, each column of them one 64-byte line of
// dst, as two 8 x 8 blocks in registers. The column-by-column loop it replaces gathered each
// value from another row: a [4096, 2176] copy took 74 ms, now 4.9 (PyTorch's .t().contiguous():
// 25.5 ms; a plain clone 4.4).
inline void transpose_rows_avx2(const float* src, idx lds, idx nr, idx w, float* dst, idx ldt) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i top = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<idx>(nr, 8))), lane);
    const __m256i bottom = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::max<idx>(nr - 8, 0))), lane);
    for (idx j = 0; j < w; j += 8) {
        const idx nc = std::min<idx>(8, w - j);
        const __m256i cols = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(nc)), lane);
        auto row = [&](idx i) {
            if (i >= nr) return _mm256_setzero_ps();
            const float* p = src + i * lds + j;
            return nc == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, cols);
        };
        __m256 lo[8], hi[8];
        for (int i = 0; i < 8; ++i) lo[i] = row(i), hi[i] = row(8 + i);
        transpose8(lo);
        transpose8(hi);
        for (idx c = 0; c < nc; ++c) {
            float* d = dst + (j + c) * ldt;
            if (nr == 16 && (reinterpret_cast<uintptr_t>(d) & 63) == 0) {  // a whole line, streamed
                _mm256_stream_ps(d, lo[c]);
                _mm256_stream_ps(d + 8, hi[c]);
            } else {
                _mm256_maskstore_ps(d, top, lo[c]);
                _mm256_maskstore_ps(d + 8, bottom, hi[c]);
            }
        }
    }
}

}  // namespace tn
#endif

namespace tn {

// transpose_rows' contract on any build: the first nr <= 64 / sizeof(Td) rows of src (rows lds
// apart, w columns) into dst transposed, column c at dst + c * ldt, rounded once to Td. AVX-512
// registers, AVX2 8 x 8 blocks (fp32 to fp32), else a loop over columns (each column's nr values
// are one line of dst, written at once). The caller ends a run of them with transpose_fence().
template <typename Ts, typename Td>
inline void transpose_block(const Ts* src, idx lds, idx nr, idx w, Td* dst, idx ldt) {
#if defined(TN_AVX512)
    transpose_rows(src, lds, nr, w, dst, ldt);
#else
#if defined(__AVX2__)
    if constexpr (std::is_same_v<Ts, float> && std::is_same_v<Td, float>) {
        transpose_rows_avx2(src, lds, nr, w, dst, ldt);
        return;
    }
#endif
    for (idx j = 0; j < w; ++j)
        for (idx r = 0; r < nr; ++r) from_float(to_float(src[r * lds + j]), dst + j * ldt + r);
#endif
}

// makes transpose_block's streamed stores visible before the caller returns
inline void transpose_fence() {
#if defined(TN_AVX512) || defined(__AVX2__)
    _mm_sfence();
#endif
}

}  // namespace tn
