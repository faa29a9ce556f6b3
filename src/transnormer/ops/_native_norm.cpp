// Fused SimpleRMSNorm (SRMSNorm, spec §5: no gain, no bias) forward and backward over rows.
//
// Why this file exists: PyTorch runs the norm as upcast, vector norm, scale, add, divide, cast,
// and autograd replays about a dozen passes backward (two divides, a masked fill for zero
// rows, sums, casts); a t2-lm block has two or three of them. Here a row is read once and
// written once per direction; fp32 arithmetic on fp32 or bf16 storage, each row's two or three
// coefficients in double.
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts (contiguous): x, y, dy, dx [N, D].  ss = sum_j x_j^2.
//   eps outside the root (released code): r = sqrt(ss / D), y = x / (r + eps)
//       dx = dy / (r + eps) - x (dy.x) / ((r + eps)^2 D r)        (second term 0 when r = 0)
//   eps inside the root (paper):          s = (ss / D + eps)^(-1/2), y = s x
//       dx = s dy - x s^3 (dy.x) / D
// A scalar gain g (ScaleNorm, y = g s x) scales y and dx; its gradient is sum_rows s (dy.x), of
// which the backward writes each row's term to rowdot (when given): the dot is computed anyway.

#include <cfloat>
#include <cmath>

#include "_native_common.h"
#include "_native_simd.h"

namespace {

using namespace tn;

#if defined(TN_AVX512)
template <typename A, typename B>
float dot(const A* a, const B* b, idx D) {
    __m512 acc = _mm512_setzero_ps();
    for (idx j = 0; j < D; j += 16) acc = _mm512_fmadd_ps(tn::load16(a + j, tn::tail_mask(D - j)), tn::load16(b + j, tn::tail_mask(D - j)), acc);
    return _mm512_reduce_add_ps(acc);
}

// out = alpha x + beta y (beta may be 0 with y = x)
template <typename X, typename Y, typename O>
void axpby(float alpha, const X* x, float beta, const Y* y, O* out, idx D) {
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (idx j = 0; j < D; j += 16) {
        const __mmask16 k = tn::tail_mask(D - j);
        tn::store16(out + j, _mm512_fmadd_ps(va, tn::load16(x + j, k), _mm512_mul_ps(vb, tn::load16(y + j, k))), k);
    }
}
#else
template <typename A, typename B>
float dot(const A* a, const B* b, idx D) {
    double acc = 0.0;
    for (idx j = 0; j < D; ++j) acc += double(to_float(a[j])) * to_float(b[j]);
    return float(acc);
}

template <typename X, typename Y, typename O>
void axpby(float alpha, const X* x, float beta, const Y* y, O* out, idx D) {
    for (idx j = 0; j < D; ++j) from_float(alpha * to_float(x[j]) + beta * to_float(y[j]), out + j);
}
#endif

// Per-row coefficients in double: in fp32, 1/((r+eps)^2 D r) and s^3/D underflow from an RMS r of
// about 1e12 (a wrong dx, 10% off at 1e13), although dx itself is of order |dy|/r.
struct Coefs {
    double scale;   // y = scale x
    double dscale;  // dx = scale dy - dscale (dy.x) x
};

inline Coefs coefs(double ss, idx D, double eps, bool inside) {
    if (inside) {
        const double s = 1.0 / std::sqrt(ss / double(D) + eps);
        return {s, s * s * s / double(D)};
    }
    const double r = std::sqrt(ss / double(D)), den = r + eps;
    return {1.0 / den, r > 0.0 ? 1.0 / (den * den * double(D) * r) : 0.0};
}

// A coefficient outside fp32's normal range, or a sum of squares outside it (rows of RMS above
// about 1.8e19/sqrt(D), or below about 1e-19 where only a tiny eps keeps the scale), sends the row
// down the double path below; rows of ordinary scale never go there.
//
// sum_unsafe: whether a row's fp32 sum of squares cannot be used as it is. A zero sum (a zero row,
// or every |x| below ~2.6e-23) only matters against an eps below 1e-15: zero rows stay on the
// fast path.
inline bool sum_unsafe(double ss, float eps) {
    return !std::isfinite(ss) || (ss < double(FLT_MIN) && (ss != 0.0 || eps < 1e-15f));
}

inline bool fp32_unsafe(double c) {
    const double a = std::fabs(c);
    return a != 0.0 && (a < double(FLT_MIN) || a > double(FLT_MAX));
}

template <typename A, typename B>
double dot_wide(const A* a, const B* b, idx D) {
    double acc = 0.0;
    for (idx j = 0; j < D; ++j) acc += double(to_float(a[j])) * double(to_float(b[j]));
    return acc;
}

template <typename X, typename Y, typename O>
void axpby_wide(double alpha, const X* x, double beta, const Y* y, O* out, idx D) {
    for (idx j = 0; j < D; ++j)
        from_float(float(alpha * double(to_float(x[j])) + beta * double(to_float(y[j]))), out + j);
}

template <typename T, typename Y>
void forward_rows(const T* x, Y* y, idx D, float eps, bool inside, float gain, idx r0, idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T* xr = x + r * D;
        double ss = dot(xr, xr, D);
        const bool wide = sum_unsafe(ss, eps);
        if (wide) ss = dot_wide(xr, xr, D);
        const double a = double(gain) * coefs(ss, D, eps, inside).scale;
        if (wide || fp32_unsafe(a)) axpby_wide(a, xr, 0.0, xr, y + r * D, D);
        else axpby(float(a), xr, 0.0f, xr, y + r * D, D);
    }
}

template <typename T, typename Y>
void backward_rows(const T* x, const Y* dy, T* dx, idx D, float eps, bool inside, float gain, float* rowdot, idx r0,
                   idx r1) {
    for (idx r = r0; r < r1; ++r) {
        const T* xr = x + r * D;
        const Y* gr = dy + r * D;
        double ss = dot(xr, xr, D), d = dot(gr, xr, D);
        const bool wide = sum_unsafe(ss, eps) || !std::isfinite(d);
        if (wide) ss = dot_wide(xr, xr, D), d = dot_wide(gr, xr, D);
        const Coefs c = coefs(ss, D, eps, inside);
        const double a = double(gain) * c.scale, b = -double(gain) * c.dscale * d;
        if (wide || fp32_unsafe(a) || fp32_unsafe(b)) axpby_wide(a, gr, b, xr, dx + r * D, D);
        else axpby(float(a), gr, float(b), xr, dx + r * D, D);
        if (rowdot) rowdot[r] = float(c.scale * d);
    }
}

}  // namespace

extern "C" {

// y (forward) and dy (backward) are bf16 when ybf16, else of x's type: an fp32 residual stream
// normalised for bf16 products is rounded once, here, instead of by a cast after.
#define TN_NORM_DEFINE(SUFFIX, T)                                                                              \
    int tn_srms_fwd_##SUFFIX(const void* x, void* y, idx N, idx D, float eps, int inside, float gain,         \
                             int ybf16, int nthreads) {                                                        \
        if (N < 0 || D < 1) return 1;                                                                          \
        const T* xs = static_cast<const T*>(x);                                                                \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                 \
            if (ybf16) forward_rows(xs, static_cast<bf16*>(y), D, eps, inside != 0, gain, r0, r1);             \
            else forward_rows(xs, static_cast<T*>(y), D, eps, inside != 0, gain, r0, r1);                      \
        });                                                                                                    \
        return 0;                                                                                              \
    }                                                                                                          \
    int tn_srms_bwd_##SUFFIX(const void* x, const void* dy, void* dx, idx N, idx D, float eps, int inside,     \
                             float gain, float* rowdot, int ybf16, int nthreads) {                             \
        if (N < 0 || D < 1) return 1;                                                                          \
        const T* xs = static_cast<const T*>(x);                                                                \
        T* dxs = static_cast<T*>(dx);                                                                          \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                 \
            if (ybf16)                                                                                         \
                backward_rows(xs, static_cast<const bf16*>(dy), dxs, D, eps, inside != 0, gain, rowdot, r0, r1); \
            else                                                                                               \
                backward_rows(xs, static_cast<const T*>(dy), dxs, D, eps, inside != 0, gain, rowdot, r0, r1);  \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_NORM_DEFINE(f32, float)
TN_NORM_DEFINE(bf16, bf16)

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// The residual add of a bf16 branch output into the fp32 stream, out = x + h: PyTorch promotes
// h to an fp32 copy first (a pass that writes twice h's bytes) and then adds.
// ---------------------------------------------------------------------------------------------
extern "C" int tn_add_upcast_f32(const float* x, const void* h, float* out, idx n, int nthreads) {
    if (n < 0) return 1;
    const idx blocks = (n + 4095) / 4096;
    tn::parallel_ranges(blocks, nthreads, [&](idx b0, idx b1) {
        const bf16* hb = static_cast<const bf16*>(h);
        const idx i1 = std::min(n, b1 * 4096);
        idx i = b0 * 4096;
#if defined(TN_AVX512)
        for (; i < i1; i += 16) {
            const __mmask16 k = tn::tail_mask(i1 - i);
            tn::store16(out + i, _mm512_add_ps(tn::load16(x + i, k), tn::load16(hb + i, k)), k);
        }
#endif
        for (; i < i1; ++i) out[i] = x[i] + to_float(hb[i]);
    });
    return 0;
}
