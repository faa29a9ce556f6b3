// FLASH's local branch between its products, one pass each way: the causal chunk attention
// a = relu(s + b)² (s the chunk's scores, b the relative-position bias) with r = relu(s + b) kept
// for the backward and aᵀ for dV = aᵀ dO; backward, dS = 2 r dA in place.
//
// Why this file exists: in PyTorch these are an add, a relu, a masked fill, a square and a
// transposing copy forward (1.6 ms a layer at 4k tokens in bf16, the copy alone 0.6) and two
// multiplies backward (1.4 ms), each a pass over the [chunks, C, C] scores. Here each score is
// read once and r, a, aᵀ written once (aᵀ as whole cache lines).
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts: s, r, a, at, ds, da [n, C, C] contiguous (n chunks); bias fp32 [C, C] (already rounded
// to the storage type, as PyTorch's add of bias.to(dtype) would see it) or null.
//   forward:  r = relu(round(s + bias)) (0 above the diagonal when causal), a = round(r r), at = aᵀ
//   backward: ds = round(da r) * 2, written over da
// The roundings are PyTorch's: results match its element-wise form bit for bit.

#include "_native_common.h"
#include "_native_simd.h"

namespace {

using namespace tn;

template <typename T>
void relu2_chunk(const T* s, const float* bias, T* r, T* a, T* at, idx C, bool causal) {
    for (idx i = 0; i < C; ++i) {
        const idx end = causal ? i + 1 : C;  // columns past it are 0
        idx j = 0;
#if defined(TN_AVX512)
        for (; j < C; j += 16) {
            const __mmask16 k = tail_mask(C - j);
            __m512 v = _mm512_setzero_ps();
            if (j < end) {
                v = load16(s + i * C + j, k);
                if (bias) v = round_to(s, _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i * C + j)));
                v = _mm512_maskz_max_ps(tail_mask(end - j), _mm512_setzero_ps(), v);  // a NaN stays NaN
            }
            store16(r + i * C + j, v, k);
            store16(a + i * C + j, _mm512_mul_ps(v, v), k);
        }
#else
        for (; j < C; ++j) {
            float v = 0.0f;
            if (j < end) {
                v = to_float(s[i * C + j]);
                if (bias) {  // rounded to T, as PyTorch's add
                    T sum;
                    from_float(v + bias[i * C + j], &sum);
                    v = to_float(sum);
                }
                v = v < 0.0f ? 0.0f : v;
            }
            from_float(v, r + i * C + j);
            from_float(v * v, a + i * C + j);
        }
#endif
    }
#if defined(TN_AVX512)
    constexpr idx kRows = 64 / sizeof(T);
    for (idx rb = 0; rb < C; rb += kRows) transpose_rows(a + rb * C, C, std::min(kRows, C - rb), C, at + rb, C);
    _mm_sfence();  // aᵀ's streamed lines
#else
    for (idx i = 0; i < C; ++i)
        for (idx j = 0; j < C; ++j) at[j * C + i] = a[i * C + j];
#endif
}

template <typename T>
void relu2_grad(T* da, const T* r, idx count) {
    idx j = 0;
#if defined(TN_AVX512)
    for (; j < count; j += 16) {
        const __mmask16 k = tail_mask(count - j);
        const __m512 v = round_to(da, _mm512_mul_ps(load16(da + j, k), load16(r + j, k)));
        store16_rounded(da + j, _mm512_add_ps(v, v), k);
    }
#endif
    for (; j < count; ++j) {
        from_float(to_float(da[j]) * to_float(r[j]), da + j);
        from_float(2.0f * to_float(da[j]), da + j);
    }
}

}  // namespace

extern "C" {

#define TN_RELU2_DEFINE(SUFFIX, T)                                                                             \
    int tn_relu2_fwd_##SUFFIX(const void* s, const float* bias, void* r, void* a, void* at, idx n, idx C,     \
                              int causal, int nthreads) {                                                     \
        if (n < 0 || C < 1) return 1;                                                                          \
        parallel_ranges(n, nthreads, [&](idx c0, idx c1) {                                                     \
            for (idx c = c0; c < c1; ++c)                                                                      \
                relu2_chunk(static_cast<const T*>(s) + c * C * C, bias, static_cast<T*>(r) + c * C * C,        \
                            static_cast<T*>(a) + c * C * C, static_cast<T*>(at) + c * C * C, C, causal != 0);  \
        });                                                                                                    \
        return 0;                                                                                              \
    }                                                                                                          \
    int tn_relu2_bwd_##SUFFIX(void* da, const void* r, idx count, int nthreads) {                              \
        if (count < 0) return 1;                                                                               \
        parallel_ranges((count + 4095) / 4096, nthreads, [&](idx b0, idx b1) {                                \
            const idx e0 = b0 * 4096, e1 = std::min(count, b1 * 4096);                                         \
            relu2_grad(static_cast<T*>(da) + e0, static_cast<const T*>(r) + e0, e1 - e0);                      \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_RELU2_DEFINE(f32, float)
TN_RELU2_DEFINE(bf16, bf16)

}  // extern "C"
