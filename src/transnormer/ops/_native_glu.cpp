// Fused SiLU gate of the GLU feed-forward: h = silu(a) * b, and its backward, in one pass each.
//
// Why this file exists: in PyTorch the gate is silu, mul forward and silu_backward, two muls
// backward, each a pass over the [tokens, ~8d/3] hidden activations (the widest tensors of a
// block), and autograd keeps silu(a) as well. Here a row of [a | b] is read once and h (or
// [da | db]) written once; fp32 arithmetic on fp32 or bf16 storage.
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts (contiguous): ab, dab [N, 2F] (a = the first F columns, b = the last F); h, dh [N, F].
//   forward:  h = silu(a) b,   silu(a) = a sigmoid(a)
//   backward: da = dh b sigmoid(a) (1 + a (1 - sigmoid(a))),   db = dh silu(a)

#include <cmath>

#include "_native_common.h"
#include "_native_simd.h"

namespace {

using namespace tn;

#if defined(TN_AVX512)
// sigmoid through exp(-|a|) <= 1, so exp never overflows: a >= 0: 1 / (1 + e), a < 0: e / (1 + e)
inline __m512 sigmoid16(__m512 a) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = tn::exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
    const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(r, neg, r, e);
}

// p[0..16) under mask k as fp32, plus bias[0..16) when there is a bias
template <typename T>
inline __m512 load_biased16(const T* p, const float* bias, __mmask16 k) {
    const __m512 a = load16(p, k);
    return bias ? _mm512_add_ps(a, _mm512_maskz_loadu_ps(k, bias)) : a;
}

// silu'(a) = s (1 + a (1 - s)) from s = sigmoid(a)
inline __m512 silu_grad16(__m512 a, __m512 s) {
    return _mm512_fmadd_ps(_mm512_mul_ps(a, s), _mm512_sub_ps(_mm512_set1_ps(1.0f), s), s);
}

template <typename T>
void forward_rows(const T* ab, T* h, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T *a = ab + r * 2 * F, *b = a + F;
        T* o = h + r * F;
        for (idx j = 0; j < F; j += 16) {
            const __mmask16 k = tn::tail_mask(F - j);
            const __m512 av = tn::load16(a + j, k);
            tn::store16(o + j, _mm512_mul_ps(_mm512_mul_ps(av, sigmoid16(av)), tn::load16(b + j, k)), k);
        }
    }
}

template <typename T>
void backward_rows(const T* ab, const T* dh, T* dab, idx F, idx r0, idx r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (idx r = r0; r < r1; ++r) {
        const T *a = ab + r * 2 * F, *b = a + F, *g = dh + r * F;
        T *da = dab + r * 2 * F, *db = da + F;
        for (idx j = 0; j < F; j += 16) {
            const __mmask16 k = tn::tail_mask(F - j);
            const __m512 av = tn::load16(a + j, k), gv = tn::load16(g + j, k);
            const __m512 s = sigmoid16(av);
            const __m512 ds = _mm512_fmadd_ps(_mm512_mul_ps(av, s), _mm512_sub_ps(one, s), s);  // silu'(a)
            tn::store16(da + j, _mm512_mul_ps(_mm512_mul_ps(gv, tn::load16(b + j, k)), ds), k);
            tn::store16(db + j, _mm512_mul_ps(gv, _mm512_mul_ps(av, s)), k);
        }
    }
}
#else
template <typename T>
void forward_rows(const T* ab, T* h, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r)
        for (idx j = 0; j < F; ++j) {
            const float a = to_float(ab[r * 2 * F + j]), b = to_float(ab[r * 2 * F + F + j]);
            from_float(a * sigmoid(a) * b, h + r * F + j);
        }
}

template <typename T>
void backward_rows(const T* ab, const T* dh, T* dab, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r)
        for (idx j = 0; j < F; ++j) {
            const float a = to_float(ab[r * 2 * F + j]), b = to_float(ab[r * 2 * F + F + j]);
            const float g = to_float(dh[r * F + j]), s = sigmoid(a);
            from_float(g * b * s * (1.0f + a * (1.0f - s)), dab + r * 2 * F + j);
            from_float(g * a * s, dab + r * 2 * F + F + j);
        }
}
#endif

}  // namespace

extern "C" {

#define TN_GLU_DEFINE(SUFFIX, T)                                                                        \
    int tn_silu_gate_fwd_##SUFFIX(const void* ab, void* h, idx N, idx F, int nthreads) {                 \
        if (N < 0 || F < 1) return 1;                                                                   \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                          \
            forward_rows(static_cast<const T*>(ab), static_cast<T*>(h), F, r0, r1);                     \
        });                                                                                             \
        return 0;                                                                                       \
    }                                                                                                   \
    int tn_silu_gate_bwd_##SUFFIX(const void* ab, const void* dh, void* dab, idx N, idx F, int nthreads) { \
        if (N < 0 || F < 1) return 1;                                                                   \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                          \
            backward_rows(static_cast<const T*>(ab), static_cast<const T*>(dh), static_cast<T*>(dab), F, r0, r1); \
        });                                                                                             \
        return 0;                                                                                       \
    }

TN_GLU_DEFINE(f32, float)
TN_GLU_DEFINE(bf16, bf16)

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// SiLU of a projection split into column groups (GAU / FLASH: [u | v | z] = silu(x W + b)).
// Forward writes each group to its own contiguous tensor; backward takes the groups' gradients
// (null = zero) and writes d(pre) in one pass: no concatenation of the three gradients first.
// The bias b (fp32 [W], or null) is added here in fp32 rather than by the projection: an addmm
// first copies b into every output row and its backward sums d(pre) over rows in another pass;
// here the backward adds each row's fp32 d(pre) into its part's sum (parts are fixed row ranges,
// so the sum does not depend on the thread count).
//   pre [N, W] with rows ldp >= W apart; out_g / dout_g [N, w_g] contiguous; dpre [N, W] contiguous;
//   dbias [parts, W] fp32, zeroed by the caller. dpre rows may be ldd >= W apart (a column block of
//   a wider gradient).
// ---------------------------------------------------------------------------------------------
namespace {

// silu of one group row: src[0..w) (+ bias) -> dst (vectorized where AVX-512 is there)
template <typename T>
inline void silu_row(const T* src, const float* bias, idx w, T* dst) {
    idx j = 0;
#if defined(TN_AVX512)
    for (; j < w; j += 16) {
        const __mmask16 k = tail_mask(w - j);
        const __m512 a = load_biased16(src + j, bias ? bias + j : nullptr, k);
        store16(dst + j, _mm512_mul_ps(a, sigmoid16(a)), k);
    }
#endif
    for (; j < w; ++j) {
        const float a = to_float(src[j]) + (bias ? bias[j] : 0.0f);
        from_float(a * sigmoid(a), dst + j);
    }
}

// d(pre) of one group row: go * silu'(pre + bias), or 0 without a gradient; added to db (fp32)
template <typename T>
inline void silu_grad_row(const T* src, const float* bias, const T* go, idx w, T* dst, float* db) {
    idx j = 0;
#if defined(TN_AVX512)
    for (; j < w; j += 16) {
        const __mmask16 k = tail_mask(w - j);
        const __m512 a = load_biased16(src + j, bias ? bias + j : nullptr, k);
        const __m512 d = go ? _mm512_mul_ps(load16(go + j, k), silu_grad16(a, sigmoid16(a))) : _mm512_setzero_ps();
        store16(dst + j, d, k);
        if (db) _mm512_mask_storeu_ps(db + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, db + j), d));
    }
#endif
    for (; j < w; ++j) {
        const float a = to_float(src[j]) + (bias ? bias[j] : 0.0f), s = sigmoid(a);
        const float d = go ? to_float(go[j]) * s * (1.0f + a * (1.0f - s)) : 0.0f;
        from_float(d, dst + j);
        if (db) db[j] += d;
    }
}

template <typename T>
void silu_split_rows(const T* pre, idx ldp, const float* bias, int ng, const idx* widths, T* const* outs, idx r0,
                     idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T* p = pre + r * ldp;
        idx c = 0;
        for (int g = 0; g < ng; ++g) {
            silu_row(p + c, bias ? bias + c : nullptr, widths[g], outs[g] + r * widths[g]);
            c += widths[g];
        }
    }
}

template <typename T>
void silu_split_bwd_rows(const T* pre, idx ldp, const float* bias, int ng, const idx* widths, const T* const* douts,
                         T* dpre, idx ldd, float* db, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T* p = pre + r * ldp;
        T* d = dpre + r * ldd;
        idx c = 0;
        for (int g = 0; g < ng; ++g) {
            silu_grad_row(p + c, bias ? bias + c : nullptr, douts[g] ? douts[g] + r * widths[g] : nullptr, widths[g],
                          d + c, db ? db + c : nullptr);
            c += widths[g];
        }
    }
}

}  // namespace

extern "C" {

#define TN_SILU_SPLIT_DEFINE(SUFFIX, T)                                                                        \
    int tn_silu_split_fwd_##SUFFIX(const void* pre, const float* bias, void* const* outs, const idx* widths,   \
                                   int ng, idx N, idx ldp, int nthreads) {                                    \
        idx W = 0;                                                                                             \
        for (int g = 0; g < ng; ++g) W += widths[g];                                                           \
        if (N < 0 || ng < 1 || ldp < W) return 1;                                                              \
        parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                     \
            silu_split_rows(static_cast<const T*>(pre), ldp, bias, ng, widths, reinterpret_cast<T* const*>(outs), \
                            r0, r1);                                                                           \
        });                                                                                                    \
        return 0;                                                                                              \
    }                                                                                                          \
    /* dbias: [parts, W] zeroed (or null); part p sums the rows [N p / parts, N (p + 1) / parts) */           \
    int tn_silu_split_bwd_##SUFFIX(const void* pre, const float* bias, const void* const* douts, const idx* widths, \
                                   int ng, void* dpre, float* dbias, idx N, idx ldp, idx ldd, idx parts,       \
                                   int nthreads) {                                                            \
        idx W = 0;                                                                                             \
        for (int g = 0; g < ng; ++g) W += widths[g];                                                           \
        if (N < 0 || ng < 1 || ldp < W || ldd < W || parts < 1) return 1;                                      \
        parallel_ranges(parts, nthreads, [&](idx p0, idx p1) {                                                 \
            for (idx p = p0; p < p1; ++p)                                                                      \
                silu_split_bwd_rows(static_cast<const T*>(pre), ldp, bias, ng, widths,                         \
                                    reinterpret_cast<const T* const*>(douts), static_cast<T*>(dpre), ldd,      \
                                    dbias ? dbias + p * W : nullptr, N * p / parts, N * (p + 1) / parts);      \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_SILU_SPLIT_DEFINE(f32, float)
TN_SILU_SPLIT_DEFINE(bf16, bf16)

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// FLASH's gate from the pre-activation: y = silu(p + b) * o, with p a column block of the
// projection (rows ldp apart). The gate u = silu(p + b) is never written: forward reads p and
// o once; backward reads dy, o and p once and writes do = dy * u and d(p) = dy * o * silu'(p + b)
// straight into its block of the projection's gradient (rows ldd apart), adding d(p) into the
// bias's fixed row parts. Against a split SiLU that writes u, a multiply, and their two backward
// passes, about five [N, F] passes fewer.
// ---------------------------------------------------------------------------------------------
namespace {

template <typename T>
void silu_mul_rows(const T* pre, idx ldp, const float* bias, const T* o, T* y, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T *p = pre + r * ldp, *orow = o + r * F;
        T* yr = y + r * F;
        idx j = 0;
#if defined(TN_AVX512)
        for (; j < F; j += 16) {
            const __mmask16 k = tail_mask(F - j);
            const __m512 a = load_biased16(p + j, bias ? bias + j : nullptr, k);
            store16(yr + j, _mm512_mul_ps(_mm512_mul_ps(a, sigmoid16(a)), load16(orow + j, k)), k);
        }
#endif
        for (; j < F; ++j) {
            const float a = to_float(p[j]) + (bias ? bias[j] : 0.0f);
            from_float(a * sigmoid(a) * to_float(orow[j]), yr + j);
        }
    }
}

template <typename T>
void silu_mul_bwd_rows(const T* pre, idx ldp, const float* bias, const T* o, const T* dy, T* dout, T* dpre, idx ldd,
                       float* db, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T *p = pre + r * ldp, *orow = o + r * F, *g = dy + r * F;
        T *dor = dout + r * F, *dp = dpre + r * ldd;
        idx j = 0;
#if defined(TN_AVX512)
        for (; j < F; j += 16) {
            const __mmask16 k = tail_mask(F - j);
            const __m512 a = load_biased16(p + j, bias ? bias + j : nullptr, k);
            const __m512 s = sigmoid16(a), gv = load16(g + j, k);
            store16(dor + j, _mm512_mul_ps(gv, _mm512_mul_ps(a, s)), k);
            const __m512 d = _mm512_mul_ps(_mm512_mul_ps(gv, load16(orow + j, k)), silu_grad16(a, s));
            store16(dp + j, d, k);
            if (db) _mm512_mask_storeu_ps(db + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, db + j), d));
        }
#endif
        for (; j < F; ++j) {
            const float a = to_float(p[j]) + (bias ? bias[j] : 0.0f), s = sigmoid(a), gv = to_float(g[j]);
            from_float(gv * a * s, dor + j);
            const float d = gv * to_float(orow[j]) * s * (1.0f + a * (1.0f - s));
            from_float(d, dp + j);
            if (db) db[j] += d;
        }
    }
}

}  // namespace

extern "C" {

#define TN_SILU_MUL_DEFINE(SUFFIX, T)                                                                          \
    int tn_silu_mul_fwd_##SUFFIX(const void* pre, const float* bias, const void* o, void* y, idx N, idx F,      \
                                 idx ldp, int nthreads) {                                                     \
        if (N < 0 || F < 1 || ldp < F) return 1;                                                               \
        parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                     \
            silu_mul_rows(static_cast<const T*>(pre), ldp, bias, static_cast<const T*>(o), static_cast<T*>(y), F, \
                          r0, r1);                                                                             \
        });                                                                                                    \
        return 0;                                                                                              \
    }                                                                                                          \
    /* dbias: [parts, F] zeroed (or null); part p sums the rows [N p / parts, N (p + 1) / parts) */           \
    int tn_silu_mul_bwd_##SUFFIX(const void* pre, const float* bias, const void* o, const void* dy, void* dout, \
                                 void* dpre, float* dbias, idx N, idx F, idx ldp, idx ldd, idx parts,         \
                                 int nthreads) {                                                              \
        if (N < 0 || F < 1 || ldp < F || ldd < F || parts < 1) return 1;                                       \
        parallel_ranges(parts, nthreads, [&](idx p0, idx p1) {                                                 \
            for (idx p = p0; p < p1; ++p)                                                                      \
                silu_mul_bwd_rows(static_cast<const T*>(pre), ldp, bias, static_cast<const T*>(o),             \
                                  static_cast<const T*>(dy), static_cast<T*>(dout), static_cast<T*>(dpre), ldd,  \
                                  dbias ? dbias + p * F : nullptr, F, N * p / parts, N * (p + 1) / parts);     \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_SILU_MUL_DEFINE(f32, float)
TN_SILU_MUL_DEFINE(bf16, bf16)

}  // extern "C"
