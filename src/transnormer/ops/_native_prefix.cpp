// FLASH's causal global prefix over chunks, in one pass: P_g = scale_g * sum_{h<g} S_h and its
// adjoint dS_h = sum_{g>h} scale_g dP_g, for chunk states in the product dtype (bf16 under
// autocast) with the running sums in double (an fp32 sum of unscaled states overflowed for states
// within a factor G of FLT_MAX, whose scaled prefixes are finite).
//
// Why this file exists: in PyTorch the prefix is an upcast of the states to fp32, a [G, G]
// lower-triangular product (cumsum over the chunk dim runs a slow strided loop) and a cast back
// for the next product: three passes over an fp32 copy, ~1.7 ms a layer each way at 4k tokens
// (16 chunks of a 128 x 1024 state). Here each element is read once and written once.
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts: x, y [B, G, n] contiguous (n = s e, a chunk's state flattened); scales [G] fp32.
//   forward  (reverse = 0): y_g = scale_g * sum_{h<g} x_h          (y_0 = 0)
//   adjoint  (reverse = 1): y_h = sum_{g>h} scale_g x_g            (y_{G-1} = 0)
// Each sum is accumulated in double in chunk order and rounded once.

#include "_native_common.h"

namespace {

using namespace tn;

constexpr idx kCols = 256;  // columns per block: the sums stay in L1

template <typename T>
void prefix_cols(const T* x, T* y, const float* scales, idx G, idx n, bool reverse, idx c0, idx c1) {
    double acc[kCols];
    for (idx b0 = c0; b0 < c1; b0 += kCols) {
        const idx w = std::min(kCols, c1 - b0);
        for (idx j = 0; j < w; ++j) acc[j] = 0.0;
        for (idx k = 0; k < G; ++k) {
            const idx g = reverse ? G - 1 - k : k;
            const T* xr = x + g * n + b0;
            T* yr = y + g * n + b0;
            const double sc = scales[g];
            if (reverse) {  // y_g is the sum of the later chunks; then this chunk joins it, scaled
                for (idx j = 0; j < w; ++j) {
                    from_float(float(acc[j]), yr + j);
                    acc[j] += sc * to_float(xr[j]);
                }
            } else {  // y_g is the scaled sum of the earlier chunks; then this chunk joins it
                for (idx j = 0; j < w; ++j) {
                    from_float(float(sc * acc[j]), yr + j);
                    acc[j] += to_float(xr[j]);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

#define TN_PREFIX_DEFINE(SUFFIX, T)                                                                            \
    int tn_chunk_prefix_##SUFFIX(const void* x, void* y, const float* scales, idx B, idx G, idx n, int reverse, \
                                 int nthreads) {                                                              \
        if (B < 0 || G < 0 || n < 0) return 1;                                                                 \
        /* the work is split over the B n columns (each runs its own sums over the chunks) */                 \
        parallel_ranges(B * ((n + kCols - 1) / kCols), nthreads, [&](idx t0, idx t1) {                         \
            const idx per = (n + kCols - 1) / kCols;                                                           \
            for (idx t = t0; t < t1; ++t) {                                                                    \
                const idx b = t / per, c0 = (t % per) * kCols, c1 = std::min(n, c0 + kCols);                   \
                prefix_cols(static_cast<const T*>(x) + b * G * n, static_cast<T*>(y) + b * G * n, scales, G, n, \
                            reverse != 0, c0, c1);                                                             \
            }                                                                                                  \
        });                                                                                                    \
        return 0;                                                                                              \
    }

TN_PREFIX_DEFINE(f32, float)
TN_PREFIX_DEFINE(bf16, bf16)

}  // extern "C"
