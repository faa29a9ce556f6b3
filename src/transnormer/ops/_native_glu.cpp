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

inline float sigmoid(float a) { return 1.0f / (1.0f + std::exp(-a)); }

#if defined(TN_AVX512)
// sigmoid through exp(-|a|) <= 1, so exp never overflows: a >= 0: 1 / (1 + e), a < 0: e / (1 + e)
inline __m512 sigmoid16(__m512 a) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = tn::exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
    const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(r, neg, r, e);
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
