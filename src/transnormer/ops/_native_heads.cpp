// Fused query/key heads of GAU / FLASH: per-head scale and offset of the shared z, then RoPE.
//
// Why this file exists: heads_h = RoPE(z * gamma_h + beta_h) is, in PyTorch, a broadcast
// multiply-add to [B, T, n, s] and a rotate-half written with cat/slices (two cats forward,
// zero-filled slice gradients backward, the cos/sin products), about 20 ms per FLASH layer at
// 4k tokens; a 12-layer flash-lm runs it 12 times per step. Here a token row of z is read once
// and its n head rows written once; backward reads the head gradients once and writes dz and
// partial sums of dgamma, dbeta over a fixed number of row parts (results do not depend on the
// thread count; at most that many threads work on the backward).
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts: z [N, s] with rows ldz >= s elements apart (a slice of the projection), fp32 or bf16;
// gamma, beta [n, s] fp32; cos, sin [N, P] fp32, rotating pairs (i, i + P) of the first 2P <= s
// channels (rotate-half), the rest passing through; y [N, n, s] or head-major [N / T, n, T, s]
// (each head's rows contiguous: the products that read one head take it without a copy; T = N is
// [n, N, s]), and dy in either layout, fp32 or bf16
// (ybf16: the heads' consumer runs under bf16 autocast; they are rounded once, as its cast would);
// dz [N, s] contiguous in z's dtype; dgamma, dbeta partials [parts, n, s] fp32.
//   x = z * gamma_h + beta_h,  y_i = x_i c_i - x_i+P s_i,  y_i+P = x_i+P c_i + x_i s_i  (i < P)

#include "_native_common.h"

namespace {

using namespace tn;

struct Shape {
    idx N, n, s, P, ldz;
    idx T;  // y's layout: 0: [N, n, s] (token-major); else [N / T, n, T, s] (head-major, T tokens a row)
    idx y_row(idx r, idx h) const { return T ? ((r / T * n + h) * T + r % T) * s : (r * n + h) * s; }
};

template <typename T, typename Y>
void forward_rows(const Shape& sh, const T* z, const float* gamma, const float* beta, const float* cos,
                  const float* sin, Y* y, idx r0, idx r1) {
    const idx n = sh.n, s = sh.s, P = sh.P;
    tn::buffer<float> zr(s), x(s), out(s);
    for (idx r = r0; r < r1; ++r) {
        for (idx j = 0; j < s; ++j) zr[j] = to_float(z[r * sh.ldz + j]);
        const float *c = cos + r * P, *sn = sin + r * P;
        for (idx h = 0; h < n; ++h) {
            const float *g = gamma + h * s, *b = beta + h * s;
            for (idx j = 0; j < s; ++j) x[j] = zr[j] * g[j] + b[j];
            for (idx i = 0; i < P; ++i) {
                out[i] = x[i] * c[i] - x[i + P] * sn[i];
                out[i + P] = x[i + P] * c[i] + x[i] * sn[i];
            }
            for (idx j = 2 * P; j < s; ++j) out[j] = x[j];
            Y* yr = y + sh.y_row(r, h);
            for (idx j = 0; j < s; ++j) from_float(out[j], yr + j);
        }
    }
}

// Rows [r0, r1) add their dgamma, dbeta into dg, db ([n, s], zeroed by the caller).
template <typename T, typename Y>
void backward_rows(const Shape& sh, const T* z, const float* gamma, const float* cos, const float* sin,
                   const Y* dy, T* dz, float* dg, float* db, idx r0, idx r1) {
    const idx n = sh.n, s = sh.s, P = sh.P;
    tn::buffer<float> zr(s), dx(s), acc(s), g(s);
    for (idx r = r0; r < r1; ++r) {
        for (idx j = 0; j < s; ++j) zr[j] = to_float(z[r * sh.ldz + j]);
        for (idx j = 0; j < s; ++j) acc[j] = 0.0f;
        const float *c = cos + r * P, *sn = sin + r * P;
        for (idx h = 0; h < n; ++h) {
            const Y* gr = dy + sh.y_row(r, h);
            for (idx j = 0; j < s; ++j) g[j] = to_float(gr[j]);
            for (idx i = 0; i < P; ++i) {  // the rotation transposed
                dx[i] = g[i] * c[i] + g[i + P] * sn[i];
                dx[i + P] = g[i + P] * c[i] - g[i] * sn[i];
            }
            for (idx j = 2 * P; j < s; ++j) dx[j] = g[j];
            const float* gm = gamma + h * s;
            float *dgh = dg + h * s, *dbh = db + h * s;
            for (idx j = 0; j < s; ++j) {
                acc[j] += dx[j] * gm[j];
                dgh[j] += dx[j] * zr[j];
                dbh[j] += dx[j];
            }
        }
        for (idx j = 0; j < s; ++j) from_float(acc[j], dz + r * s + j);
    }
}

bool bad(const Shape& sh) { return sh.N < 0 || sh.n < 1 || sh.s < 1 || sh.P < 0 || 2 * sh.P > sh.s || sh.ldz < sh.s; }

}  // namespace

extern "C" {

#define TN_HEADS_DEFINE(SUFFIX, T)                                                                              \
    int tn_heads_fwd_##SUFFIX(const void* z, const float* gamma, const float* beta, const float* cos,           \
                              const float* sin, void* y, idx N, idx n, idx s, idx P, idx ldz, int ybf16,         \
                              idx head_major_T, int nthreads) {                                                 \
        const Shape sh{N, n, s, P, ldz, head_major_T};                                                          \
        if (bad(sh) || head_major_T < 0 || (head_major_T && N % head_major_T)) return 1;                        \
        parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                      \
            if (ybf16)                                                                                          \
                forward_rows(sh, static_cast<const T*>(z), gamma, beta, cos, sin, static_cast<bf16*>(y), r0, r1); \
            else                                                                                                \
                forward_rows(sh, static_cast<const T*>(z), gamma, beta, cos, sin, static_cast<float*>(y), r0, r1); \
        });                                                                                                     \
        return 0;                                                                                               \
    }                                                                                                           \
    /* dg, db: [parts, n, s] zeroed; part p sums the rows [N p / parts, N (p + 1) / parts) */                  \
    int tn_heads_bwd_##SUFFIX(const void* z, const float* gamma, const float* cos, const float* sin,            \
                              const void* dy, void* dz, float* dg, float* db, idx N, idx n, idx s, idx P,        \
                              idx ldz, idx parts, int ybf16, idx head_major_T, int nthreads) {                  \
        const Shape sh{N, n, s, P, ldz, head_major_T};                                                          \
        if (bad(sh) || parts < 1 || head_major_T < 0 || (head_major_T && N % head_major_T)) return 1;           \
        parallel_row_parts(N, parts, nthreads, [&](idx p, idx r0, idx r1) {                                     \
            float *dgp = dg + p * n * s, *dbp = db + p * n * s;                                                 \
            if (ybf16)                                                                                          \
                backward_rows(sh, static_cast<const T*>(z), gamma, cos, sin, static_cast<const bf16*>(dy),      \
                              static_cast<T*>(dz), dgp, dbp, r0, r1);                                           \
            else                                                                                                \
                backward_rows(sh, static_cast<const T*>(z), gamma, cos, sin, static_cast<const float*>(dy),     \
                              static_cast<T*>(dz), dgp, dbp, r0, r1);                                           \
        });                                                                                                     \
        return 0;                                                                                               \
    }

TN_HEADS_DEFINE(f32, float)
TN_HEADS_DEFINE(bf16, bf16)

}  // extern "C"
