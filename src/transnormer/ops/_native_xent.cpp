// Fused softmax cross-entropy over rows of logits, in place (the LM loss's element-wise part).
//
// Why this file exists: for each chunk of rows, modules/lm_loss.py needs, per row, the
// loss term log-sum-exp - target logit and the gradient softmax - onehot. In PyTorch that is a
// bf16 -> fp32 copy, max, subtract, exp, sum, divide, a scatter and a mask multiply, plus a copy
// back to bf16: about nine passes over a [rows, V] block of hundreds of megabytes. Here one
// thread takes a row (V floats fit in L2), reads it once from memory and writes the gradient
// over it, in the logits' own dtype (fp32 or bf16; the arithmetic is fp32 throughout).
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// tn_xent_rows_{f32,bf16}(x, n, V, ld, labels, valid, lse, loss, write_grad, nthreads):
//   x       [n, V] logits, row stride ld (elements); overwritten with the gradient if write_grad
//   labels  [n] int64 in [0, V) (the caller clamps ignored rows' labels to a valid index)
//   valid   [n] uint8: 0 = ignored row (its gradient row is all zeros)
//   lse     [n] fp32 out: log sum_j exp(x_ij)
//   loss    [n] fp32 out: (max_j x_ij - x_i,labels_i) + log sum_j exp(x_ij - max): lse - target
//           without rounding lse first (at logits ~1e4 an fp32 lse is ~1e-3 off, the loss 1e-4)
//   gradient: g_ij = valid_i * (exp(x_ij - lse_i) - [j == labels_i])
// Returns 0, or 1 for bad sizes / labels.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "_native_common.h"
#include "_native_simd.h"

namespace {

using namespace tn;

#if defined(TN_AVX512)
// One row: returns (max, sum of exp(x - max)) and leaves exp(x - max) in e[0..V).
template <typename T>
void row_exp(const T* x, idx V, float* e, float& mx, float& sum) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (idx j = 0; j < V; j += 16) vm = _mm512_mask_max_ps(vm, tn::tail_mask(V - j), vm, tn::load16(x + j, tn::tail_mask(V - j)));
    mx = _mm512_reduce_max_ps(vm);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 vs = _mm512_setzero_ps();
    for (idx j = 0; j < V; j += 16) {
        const __mmask16 k = tn::tail_mask(V - j);
        const __m512 ex = tn::exp16(_mm512_sub_ps(tn::load16(x + j, k), m));
        vs = _mm512_mask_add_ps(vs, k, vs, ex);
        _mm512_mask_storeu_ps(e + j, k, ex);
    }
    sum = _mm512_reduce_add_ps(vs);
}

template <typename T>
void row_scale(const float* e, idx V, float scale, T* g) {
    const __m512 s = _mm512_set1_ps(scale);
    for (idx j = 0; j < V; j += 16) {
        const __mmask16 k = tn::tail_mask(V - j);
        tn::store16(g + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, e + j), s), k);
    }
}
#else
// The portable path keeps 16 partial maxima and sums, as the AVX-512 one does, in fixed-width
// inner loops the compiler vectorizes (AVX2: two vectors of 8), with exp by the polynomial of
// _native_common.h. (A sequential double sum with std::exp did not vectorize: on an AVX2 EPYC one
// 2048 x 32k fp32 block took 232 ms, twice PyTorch's 110-122; now 51-61 ms.)
constexpr int kLanes = 16;

template <typename T>
void row_exp(const T* x, idx V, float* e, float& mx, float& sum) {
    float m[kLanes], s[kLanes];
    for (int l = 0; l < kLanes; ++l) m[l] = -INFINITY, s[l] = 0.0f;
    const idx Vb = V / kLanes * kLanes;
    for (idx j = 0; j < Vb; j += kLanes)
        for (int l = 0; l < kLanes; ++l) {
            const float v = to_float(x[j + l]);
            m[l] = v > m[l] ? v : m[l];
        }
    for (idx j = Vb; j < V; ++j) {
        const float v = to_float(x[j]);
        m[j - Vb] = v > m[j - Vb] ? v : m[j - Vb];
    }
    mx = m[0];
    for (int l = 1; l < kLanes; ++l) mx = m[l] > mx ? m[l] : mx;
    for (idx j = 0; j < Vb; j += kLanes)
        for (int l = 0; l < kLanes; ++l) s[l] += (e[j + l] = exp_nonpositive(to_float(x[j + l]) - mx));
    for (idx j = Vb; j < V; ++j) s[j - Vb] += (e[j] = exp_nonpositive(to_float(x[j]) - mx));
    sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += s[l];
}

template <typename T>
void row_scale(const float* e, idx V, float scale, T* g) {
    for (idx j = 0; j < V; ++j) from_float(e[j] * scale, g + j);
}
#endif

template <typename T>
void rows(T* x, idx r0, idx r1, idx V, idx ld, const int64_t* labels, const uint8_t* valid, float* lse,
          float* loss, bool write_grad) {
    tn::buffer<float> e(V);
    for (idx i = r0; i < r1; ++i) {
        T* row = x + i * ld;
        float mx, sum;
        row_exp(row, V, e.data(), mx, sum);
        const float l = std::log(sum);
        lse[i] = mx + l;
        loss[i] = (mx - to_float(row[labels[i]])) + l;  // (read before the row is overwritten)
        if (!write_grad) continue;
        if (!valid[i]) {
            row_scale(e.data(), V, 0.0f, row);
            continue;
        }
        row_scale(e.data(), V, 1.0f / sum, row);
        // e/sum - 1 at the label, rounded once like the rest of the row
        from_float(e[labels[i]] / sum - 1.0f, row + labels[i]);
    }
}

template <typename T>
int xent_all(T* x, idx n, idx V, idx ld, const int64_t* labels, const uint8_t* valid, float* lse, float* loss,
             int write_grad, int nthreads) {
    if (n < 0 || V < 1 || ld < V) return 1;
    for (idx i = 0; i < n; ++i)
        if (labels[i] < 0 || labels[i] >= V) return 1;
    tn::parallel_ranges(n, nthreads, [&](idx r0, idx r1) { rows(x, r0, r1, V, ld, labels, valid, lse, loss, write_grad != 0); });
    return 0;
}

}  // namespace

extern "C" {

int tn_xent_rows_f32(float* x, idx n, idx V, idx ld, const int64_t* labels, const uint8_t* valid, float* lse,
                     float* loss, int write_grad, int nthreads) {
    return xent_all(x, n, V, ld, labels, valid, lse, loss, write_grad, nthreads);
}

int tn_xent_rows_bf16(void* x, idx n, idx V, idx ld, const int64_t* labels, const uint8_t* valid, float* lse,
                      float* loss, int write_grad, int nthreads) {
    return xent_all(static_cast<bf16*>(x), n, V, ld, labels, valid, lse, loss, write_grad, nthreads);
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// dst[C, R] (fp32, contiguous) = or += src[R, C]^T (bf16, contiguous): the LM head's weight
// gradient. oneDNN runs the bf16 product x^T g ([d, n] . [n, V]) at about twice the rate of
// g^T x ([V, n] . [n, d]); this turns its [d, V] result into the [V, d] gradient (fp32 sum over
// row chunks) in one pass of 16 x 16 tiles through L1; it is bound by memory bandwidth (an AVX-512
// gather version ran no faster).
// ---------------------------------------------------------------------------------------------
namespace {

void transpose_acc_cols(const bf16* src, idx R, idx C, float* dst, bool acc, idx c0, idx c1) {
    alignas(64) float tile[16 * 16];
    for (idx cb = c0; cb < c1; cb += 16) {
        const idx nc = std::min<idx>(16, c1 - cb);
        for (idx rb = 0; rb < R; rb += 16) {
            const idx nr = std::min<idx>(16, R - rb);
            for (idx i = 0; i < nr; ++i)
                for (idx j = 0; j < nc; ++j) tile[j * 16 + i] = to_float(src[(rb + i) * C + cb + j]);
            for (idx j = 0; j < nc; ++j) {
                float* d = dst + (cb + j) * R + rb;
                const float* t = tile + j * 16;
                if (acc)
                    for (idx i = 0; i < nr; ++i) d[i] += t[i];
                else
                    for (idx i = 0; i < nr; ++i) d[i] = t[i];
            }
        }
    }
}

}  // namespace

extern "C" int tn_transpose_acc_bf16(const void* src, idx R, idx C, float* dst, int accumulate, int nthreads) {
    if (R < 0 || C < 0) return 1;
    // split the columns (the rows of dst) in blocks of 16 over the threads
    const idx nb = (C + 15) / 16;
    parallel_ranges(nb, nthreads, [&](idx b0, idx b1) {
        transpose_acc_cols(static_cast<const bf16*>(src), R, C, dst, accumulate != 0, b0 * 16, std::min(C, b1 * 16));
    });
    return 0;
}
