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

// Rows [r0, r1) of a projection's gradient, written by write_rows(ra, rb) in blocks of 64 bytes'
// worth of dst_t's rows. With dst_t, each block is then transposed from dst (w columns, rows ldd
// apart) into dst_t (column c at dst_t + c * ldt) while it is still in cache, so the copy holds
// exactly the values stored. The copy serves dW = dYᵀ X with dYᵀ contiguous: oneDNN's bf16 GEMM
// reads a transposed dY at about half its rate, and a separate transposed copy costs another pass.
template <typename T, typename Rows>
inline void rows_with_transpose(idx r0, idx r1, const T* dst, idx ldd, idx w, T* dst_t, idx ldt, Rows write_rows) {
    constexpr idx kRows = 64 / sizeof(T);
    for (idx rb = r0; rb < r1; rb += kRows) {
        const idx nr = std::min<idx>(kRows, r1 - rb);
        write_rows(rb, rb + nr);
        if (dst_t) transpose_block(dst + rb * ldd, ldd, nr, w, dst_t + rb, ldt);
    }
    if (dst_t) transpose_fence();
}

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
void forward_rows(const T* ab, const float* bias, T* h, idx F, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T *a = ab + r * 2 * F, *b = a + F;
        T* o = h + r * F;
        for (idx j = 0; j < F; j += 16) {
            const __mmask16 k = tn::tail_mask(F - j);
            const __m512 av = load_biased16(a + j, bias ? bias + j : nullptr, k);
            const __m512 bv = load_biased16(b + j, bias ? bias + F + j : nullptr, k);
            tn::store16(o + j, _mm512_mul_ps(_mm512_mul_ps(av, sigmoid16(av)), bv), k);
        }
    }
}

// rows [r0, r1): dab (and, with dab_t, its transpose: rows_with_transpose) and the bias gradient's
// fp32 sums db [2F] (or null) with the rows in order
template <typename T>
void backward_rows(const T* ab, const float* bias, const T* dh, T* dab, T* dab_t, idx ldt, float* db, idx F, idx r0,
                   idx r1) {
    rows_with_transpose(r0, r1, dab, 2 * F, 2 * F, dab_t, ldt, [&](idx ra, idx rb) {
        for (idx r = ra; r < rb; ++r) {
            const T *a = ab + r * 2 * F, *b = a + F, *g = dh + r * F;
            T *da = dab + r * 2 * F, *dbr = da + F;
            for (idx j = 0; j < F; j += 16) {
                const __mmask16 k = tn::tail_mask(F - j);
                const __m512 av = load_biased16(a + j, bias ? bias + j : nullptr, k), gv = tn::load16(g + j, k);
                const __m512 bv = load_biased16(b + j, bias ? bias + F + j : nullptr, k);
                const __m512 s = sigmoid16(av);
                const __m512 ga = _mm512_mul_ps(_mm512_mul_ps(gv, bv), silu_grad16(av, s));
                const __m512 gb = _mm512_mul_ps(gv, _mm512_mul_ps(av, s));
                tn::store16(da + j, ga, k);
                tn::store16(dbr + j, gb, k);
                if (db) {
                    _mm512_mask_storeu_ps(db + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, db + j), ga));
                    _mm512_mask_storeu_ps(db + F + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, db + F + j), gb));
                }
            }
        }
    });
}
#else
// The portable loops: with_flag makes "is there a bias" and "sum the bias gradient" constants
// inside them, so they have no branch and vectorize (AVX2: 8 lanes).
template <typename T>
void forward_rows(const T* ab, const float* bias, T* h, idx F, idx r0, idx r1) {
    with_flag(bias != nullptr, [&](auto has_bias) {
        for (idx r = r0; r < r1; ++r) {
            const T *a = ab + r * 2 * F, *b = a + F;
            T* o = h + r * F;
            for (idx j = 0; j < F; ++j) {
                const float av = to_float(a[j]) + (has_bias ? bias[j] : 0.0f);
                const float bv = to_float(b[j]) + (has_bias ? bias[F + j] : 0.0f);
                from_float(av * sigmoid(av) * bv, o + j);
            }
        }
    });
}

// one row; restrict: with seven pointers that might overlap GCC gave up on the runtime checks
// and left the bf16 loop scalar
template <bool HasBias, bool SumDb, typename T>
inline void backward_row(const T* __restrict a, const T* __restrict b, const T* __restrict g,
                         const float* __restrict bias, T* __restrict da, T* __restrict dbr, float* __restrict db,
                         idx F) {
    for (idx j = 0; j < F; ++j) {
        const float av = to_float(a[j]) + (HasBias ? bias[j] : 0.0f);
        const float bv = to_float(b[j]) + (HasBias ? bias[F + j] : 0.0f);
        const float gv = to_float(g[j]), s = sigmoid(av);
        const float ga = gv * bv * s * (1.0f + av * (1.0f - s)), gb = gv * av * s;
        from_float(ga, da + j);
        from_float(gb, dbr + j);
        if (SumDb) db[j] += ga, db[F + j] += gb;
    }
}

template <typename T>
void backward_rows(const T* ab, const float* bias, const T* dh, T* dab, T* dab_t, idx ldt, float* db, idx F, idx r0,
                   idx r1) {
    with_flag(bias != nullptr, [&](auto has_bias) {
        with_flag(db != nullptr, [&](auto sum_db) {
            rows_with_transpose(r0, r1, dab, 2 * F, 2 * F, dab_t, ldt, [&](idx ra, idx rb) {
                for (idx r = ra; r < rb; ++r) {
                    const T* a = ab + r * 2 * F;
                    // (decltype: a captured flag is not a constant expression for every compiler)
                    backward_row<decltype(has_bias)::value, decltype(sum_db)::value>(
                        a, a + F, dh + r * F, bias, dab + r * 2 * F, dab + r * 2 * F + F, db, F);
                }
            });
        });
    });
}
#endif

}  // namespace

extern "C" {

// 1 where the row kernels' loops are AVX-512 code; without it they are portable loops the compiler
// vectorizes, and FLASH's fused mixer runs its bf16 transposed copies column by column (ops/_native.py,
// rows_usable)
int tn_rows_avx512() {
#if defined(TN_AVX512)
    return 1;
#else
    return 0;
#endif
}

// 1 where the fp32 transposed copies of the gradient kernels run on vectors (AVX-512 or AVX2,
// transpose_block): without them FLASH's fused mixer ran slower than its composed form
int tn_rows_avx2() {
#if defined(TN_AVX512) || defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* bias: fp32 [2F] (b1 | b2) or null; dbias: [parts, 2F] zeroed (or null), part p summing the rows \
   [N p / parts, N (p + 1) / parts); dab_t: d(ab)ᵀ [2F, N] with rows ldt >= N apart, or null */        \
#define TN_GLU_DEFINE(SUFFIX, T)                                                                        \
    int tn_silu_gate_fwd_##SUFFIX(const void* ab, const float* bias, void* h, idx N, idx F, int nthreads) { \
        if (N < 0 || F < 1) return 1;                                                                   \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                          \
            forward_rows(static_cast<const T*>(ab), bias, static_cast<T*>(h), F, r0, r1);               \
        });                                                                                             \
        return 0;                                                                                       \
    }                                                                                                   \
    int tn_silu_gate_bwd_##SUFFIX(const void* ab, const float* bias, const void* dh, void* dab, void* dab_t, \
                                  float* dbias, idx N, idx F, idx ldt, idx parts, int nthreads) {       \
        if (N < 0 || F < 1 || parts < 1 || (dab_t && ldt < N)) return 1;                                \
        tn::parallel_row_parts(N, parts, nthreads, [&](idx p, idx r0, idx r1) {                         \
            backward_rows(static_cast<const T*>(ab), bias, static_cast<const T*>(dh), static_cast<T*>(dab),   \
                          static_cast<T*>(dab_t), ldt, dbias ? dbias + p * 2 * F : nullptr, F, r0, r1);       \
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
//   a wider gradient). dpre_t (or null): d(pre)ᵀ, column j of d(pre) at dpre_t + j * ldt, ldt >= N
//   (see write_grad_rows; the gate's backward below takes the same two arguments).
// ---------------------------------------------------------------------------------------------
namespace {

// A gradient block of a projection's output, written row by row (dX = dY W) and, with dst_t, also
// transposed (rows_with_transpose). grad(r, j, k) is the fp32 gradient of row r, columns [j, j + 16)
// under mask k; it is stored at dst + r * ldd + j in T and added into db[j..] (fp32, or null) with
// the rows in order.
template <typename T, typename Grad>
inline void write_grad_rows(idx r0, idx r1, idx w, T* dst, idx ldd, float* db, T* dst_t, idx ldt, Grad grad) {
    rows_with_transpose(r0, r1, dst, ldd, w, dst_t, ldt, [&](idx ra, idx rb) {
        for (idx r = ra; r < rb; ++r) {
#if defined(TN_AVX512)
            for (idx j = 0; j < w; j += 16) {
                const __mmask16 k = tail_mask(w - j);
                const __m512 d = grad(r, j, k);
                store16(dst + r * ldd + j, d, k);
                if (db) _mm512_mask_storeu_ps(db + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, db + j), d));
            }
#else
            if (db)  // two loops, neither with a branch: both vectorize
                for (idx j = 0; j < w; ++j) {
                    const float d = grad(r, j);
                    from_float(d, dst + r * ldd + j);
                    db[j] += d;
                }
            else
                for (idx j = 0; j < w; ++j) from_float(grad(r, j), dst + r * ldd + j);
#endif
        }
    });
}

// silu of one group row: src[0..w) (+ bias) -> dst
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
    auto put = [&](idx i, float a) { from_float(a * sigmoid(a), dst + i); };
    if (bias)
        for (; j < w; ++j) put(j, to_float(src[j]) + bias[j]);
    else
        for (; j < w; ++j) put(j, to_float(src[j]));
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

// d(pre) = go * silu'(pre + bias) of each group's columns (0 where the group has no gradient)
template <typename T>
void silu_split_bwd_rows(const T* pre, idx ldp, const float* bias, int ng, const idx* widths, const T* const* douts,
                         T* dpre, idx ldd, T* dpre_t, idx ldt, float* db, idx r0, idx r1) {
    idx c = 0;
    for (int g = 0; g < ng; ++g) {
        const T* p = pre + c;
        const T* go = douts[g];
        const float* b = bias ? bias + c : nullptr;
        const idx w = widths[g];
#if defined(TN_AVX512)
        auto grad = [&](idx r, idx j, __mmask16 k) {
            if (!go) return _mm512_setzero_ps();
            const __m512 a = load_biased16(p + r * ldp + j, b ? b + j : nullptr, k);
            return _mm512_mul_ps(load16(go + r * w + j, k), silu_grad16(a, sigmoid16(a)));
        };
        write_grad_rows(r0, r1, w, dpre + c, ldd, db ? db + c : nullptr, dpre_t ? dpre_t + c * ldt : nullptr, ldt,
                        grad);
#else
        auto write = [&](auto grad) {
            write_grad_rows(r0, r1, w, dpre + c, ldd, db ? db + c : nullptr, dpre_t ? dpre_t + c * ldt : nullptr, ldt,
                            grad);
        };
        if (!go) write([](idx, idx) { return 0.0f; });
        else with_flag(b != nullptr, [&](auto has_bias) {
            write([&](idx r, idx j) {
                const float a = to_float(p[r * ldp + j]) + (has_bias ? b[j] : 0.0f), s = sigmoid(a);
                return to_float(go[r * w + j]) * s * (1.0f + a * (1.0f - s));
            });
        });
#endif
        c += w;
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
                                   int ng, void* dpre, void* dpre_t, float* dbias, idx N, idx ldp, idx ldd,    \
                                   idx ldt, idx parts, int nthreads) {                                        \
        idx W = 0;                                                                                             \
        for (int g = 0; g < ng; ++g) W += widths[g];                                                           \
        if (N < 0 || ng < 1 || ldp < W || ldd < W || (dpre_t && ldt < N) || parts < 1) return 1;               \
        parallel_row_parts(N, parts, nthreads, [&](idx p, idx r0, idx r1) {                                    \
            silu_split_bwd_rows(static_cast<const T*>(pre), ldp, bias, ng, widths,                             \
                                reinterpret_cast<const T* const*>(douts), static_cast<T*>(dpre), ldd,          \
                                static_cast<T*>(dpre_t), ldt, dbias ? dbias + p * W : nullptr, r0, r1);        \
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
        auto put = [&](idx i, float a) { from_float(a * sigmoid(a) * to_float(orow[i]), yr + i); };
        if (bias)
            for (; j < F; ++j) put(j, to_float(p[j]) + bias[j]);
        else
            for (; j < F; ++j) put(j, to_float(p[j]));
    }
}

#if !defined(TN_AVX512)
// one row of the portable backward; restrict (as backward_row): through write_grad_rows' lambda,
// with do stored beside d(pre), the loop had stayed scalar (32 ms a flash-lm layer's step at
// T = 4096 on an AVX2 EPYC, against 11 ms for the split SiLU's wider backward)
template <bool HasBias, bool SumDb, typename T>
inline void silu_mul_bwd_row(const T* __restrict p, const float* __restrict bias, const T* __restrict o,
                             const T* __restrict dy, T* __restrict dout, T* __restrict dp, float* __restrict db,
                             idx F) {
    for (idx j = 0; j < F; ++j) {
        const float a = to_float(p[j]) + (HasBias ? bias[j] : 0.0f), s = sigmoid(a), gv = to_float(dy[j]);
        const float d = gv * to_float(o[j]) * s * (1.0f + a * (1.0f - s));
        from_float(gv * a * s, dout + j);
        from_float(d, dp + j);
        if (SumDb) db[j] += d;
    }
}
#endif

template <typename T>
void silu_mul_bwd_rows(const T* pre, idx ldp, const float* bias, const T* o, const T* dy, T* dout, T* dpre, idx ldd,
                       T* dpre_t, idx ldt, float* db, idx F, idx r0, idx r1) {
#if defined(TN_AVX512)
    auto grad = [&](idx r, idx j, __mmask16 k) {  // writes do as it goes; returns d(pre)
        const __m512 a = load_biased16(pre + r * ldp + j, bias ? bias + j : nullptr, k);
        const __m512 s = sigmoid16(a), gv = load16(dy + r * F + j, k);
        store16(dout + r * F + j, _mm512_mul_ps(gv, _mm512_mul_ps(a, s)), k);
        return _mm512_mul_ps(_mm512_mul_ps(gv, load16(o + r * F + j, k)), silu_grad16(a, s));
    };
    write_grad_rows(r0, r1, F, dpre, ldd, db, dpre_t, ldt, grad);
#else
    with_flag(bias != nullptr, [&](auto has_bias) {
        with_flag(db != nullptr, [&](auto sum_db) {
            rows_with_transpose(r0, r1, dpre, ldd, F, dpre_t, ldt, [&](idx ra, idx rb) {
                for (idx r = ra; r < rb; ++r)
                    silu_mul_bwd_row<decltype(has_bias)::value, decltype(sum_db)::value>(
                        pre + r * ldp, bias, o + r * F, dy + r * F, dout + r * F, dpre + r * ldd, db, F);
            });
        });
    });
#endif
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
                                 void* dpre, void* dpre_t, float* dbias, idx N, idx F, idx ldp, idx ldd,      \
                                 idx ldt, idx parts, int nthreads) {                                          \
        if (N < 0 || F < 1 || ldp < F || ldd < F || (dpre_t && ldt < N) || parts < 1) return 1;                \
        parallel_row_parts(N, parts, nthreads, [&](idx p, idx r0, idx r1) {                                    \
            silu_mul_bwd_rows(static_cast<const T*>(pre), ldp, bias, static_cast<const T*>(o),                 \
                              static_cast<const T*>(dy), static_cast<T*>(dout), static_cast<T*>(dpre), ldd,      \
                              static_cast<T*>(dpre_t), ldt, dbias ? dbias + p * F : nullptr, F, r0, r1);       \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_SILU_MUL_DEFINE(f32, float)
TN_SILU_MUL_DEFINE(bf16, bf16)

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// A projection's weight W [R, C] (fp32 or bf16) as the contiguous Wᵀ [C, R] of the compute dtype,
// rounded once: the operand of X Wᵀ as a plain row-major B, which oneDNN's bf16 GEMM runs faster
// than a transposed view, made in one pass where a cast and PyTorch's transposing copy take two
// slow ones. Rows of W (columns of Wᵀ) are split over the threads in blocks of one line of Wᵀ.
// ---------------------------------------------------------------------------------------------
namespace {

// rows [r0, r1) of src [R, C] into the columns [r0, r1) of dst [C, R]
template <typename Ts, typename Td>
void cast_transpose_rows(const Ts* src, idx R, idx C, Td* dst, idx r0, idx r1) {
    constexpr idx kRows = 64 / sizeof(Td);
    for (idx rb = r0; rb < r1; rb += kRows) transpose_block(src + rb * C, C, std::min(kRows, r1 - rb), C, dst + rb, R);
    transpose_fence();
}

// each of nb matrices: dst[b] [C, R] = src[b] [R, C]ᵀ
template <typename Td>
int cast_transpose(const void* src, int src_bf16, Td* dst, idx nb, idx R, idx C, int nthreads) {
    if (nb < 0 || R < 0 || C < 0) return 1;
    // whole rows of src per thread (long contiguous reads), in blocks of one cache line of dst
    constexpr idx kRows = 64 / sizeof(Td);
    const idx blocks = (R + kRows - 1) / kRows;
    parallel_ranges(nb * blocks, nthreads, [&](idx k0, idx k1) {
        for (idx k = k0; k < k1; ++k) {
            const idx b = k / blocks, r0 = k % blocks * kRows, r1 = std::min(R, r0 + kRows);
            if (src_bf16)
                cast_transpose_rows(static_cast<const bf16*>(src) + b * R * C, R, C, dst + b * R * C, r0, r1);
            else
                cast_transpose_rows(static_cast<const float*>(src) + b * R * C, R, C, dst + b * R * C, r0, r1);
        }
    });
    return 0;
}

}  // namespace

extern "C" {
// dst [nb, C, R] (the suffix's dtype) = each srcᵀ for contiguous src [nb, R, C], fp32 or (src_bf16) bf16
int tn_cast_transpose_f32(const void* src, int src_bf16, void* dst, idx nb, idx R, idx C, int nthreads) {
    return cast_transpose(src, src_bf16, static_cast<float*>(dst), nb, R, C, nthreads);
}
int tn_cast_transpose_bf16(const void* src, int src_bf16, void* dst, idx nb, idx R, idx C, int nthreads) {
    return cast_transpose(src, src_bf16, static_cast<bf16*>(dst), nb, R, C, nthreads);
}
}  // extern "C"
