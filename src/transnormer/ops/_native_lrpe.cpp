// Fused feature map of NormAttention / DiagAttention: kernel, Householder reflection, rotation.
//
// Why this file exists: y = R_m · s(I - 2uu^T) · phi(x) per head row is a handful of
// element-wise passes in PyTorch (the kernel, a [D, 2D] matmul, the cos/sin products and their
// sum), each reading and writing the whole [B, T, H, D] tensor, and autograd keeps and replays
// them all: about 20 ms per call at 4k tokens in bf16, twelve calls per t2-lm step. The
// reflection is rank one, so a row needs one dot product; here a row is read once, worked on in
// fp32 registers and written once, forward and backward.
//
// Built with the other kernels into one library by transnormer/ops/_native.py.
//
// Layouts: x, y, dy, dx [N, H, D] (N = B*T rows of H heads), D even, all contiguous except that
// x's rows may be ldx >= H*D elements apart (q and k as views of one fused qkv projection);
// cos, sin, dcos, dsin [N, D/2] fp32 (one angle per pair, shared by the heads of a row);
// u [D] fp32 or null (no reflection). Pairs are interleaved, (2i, 2i+1):
//   f = phi(x),  z = s (f - 2 (f.u) u),  y_2i = z_2i c_i - z_2i+1 s_i,  y_2i+1 = z_2i+1 c_i + z_2i s_i
// Kernels phi: 0 identity, 1 elu, 2 1+elu, 3 relu.

#include <algorithm>
#include <vector>

#include "_native_common.h"
#include "_native_simd.h"

namespace {

using namespace tn;

// The kernel is a template argument, so that the loops calling these have no branch on it and
// vectorize (the portable path: AVX2 takes 8 lanes).
template <int K>
inline float phi(float v) {
    if constexpr (K == 0) return v;
    if constexpr (K == 3) return v > 0.0f ? v : 0.0f;
    const float elu = v > 0.0f ? v : expm1_nonpositive(v > 0.0f ? 0.0f : v);
    return K == 1 ? elu : elu + 1.0f;
}

template <int K>
inline float dphi(float v) {
    if constexpr (K == 0) return 1.0f;
    if constexpr (K == 3) return v > 0.0f ? 1.0f : 0.0f;
    return v > 0.0f ? 1.0f : exp_nonpositive(v > 0.0f ? 0.0f : v);
}

struct Args {
    idx H, D, ldx;  // ldx: x's row stride (elements); y, dy, dx rows are H * D apart
    const float *cos, *sin, *u;
    float scale;
    int kern;
};

// z = s (phi(x) - 2 (phi(x).u) u) for one head row
template <int K, typename T>
inline void reflect(const Args& a, const T* x, float* z) {
    const idx D = a.D;
    for (idx j = 0; j < D; ++j) z[j] = phi<K>(to_float(x[j]));
    if (a.u) {
        float dot = 0.0f;
        for (idx j = 0; j < D; ++j) dot += z[j] * a.u[j];
        const float two_dot = 2.0f * dot;
        for (idx j = 0; j < D; ++j) z[j] = a.scale * (z[j] - two_dot * a.u[j]);
    } else {
        for (idx j = 0; j < D; ++j) z[j] *= a.scale;
    }
}

template <int K, typename T>
void forward_rows(const Args& a, const T* x, T* y, idx r0, idx r1) {
    const idx H = a.H, D = a.D, P = D / 2;
    tn::buffer<float> z(D);
    for (idx r = r0; r < r1; ++r) {
        const float *c = a.cos + r * P, *s = a.sin + r * P;
        for (idx h = 0; h < H; ++h) {
            const idx off = (r * H + h) * D;
            reflect<K>(a, x + r * a.ldx + h * D, z.data());
            T* yr = y + off;
            for (idx i = 0; i < P; ++i) {
                from_float(z[2 * i] * c[i] - z[2 * i + 1] * s[i], yr + 2 * i);
                from_float(z[2 * i + 1] * c[i] + z[2 * i] * s[i], yr + 2 * i + 1);
            }
        }
    }
}

template <int K, typename T>
void backward_rows(const Args& a, const T* x, const T* dy, T* dx, float* dcos, float* dsin, idx r0, idx r1) {
    const idx H = a.H, D = a.D, P = D / 2;
    tn::buffer<float> z(D), g(D), dz(D);
    for (idx r = r0; r < r1; ++r) {
        const float *c = a.cos + r * P, *s = a.sin + r * P;
        float *dc = dcos + r * P, *ds = dsin + r * P;
        for (idx i = 0; i < P; ++i) dc[i] = ds[i] = 0.0f;
        for (idx h = 0; h < H; ++h) {
            const idx off = (r * H + h) * D;
            const T* xr = x + r * a.ldx + h * D;
            reflect<K>(a, xr, z.data());
            for (idx j = 0; j < D; ++j) g[j] = to_float(dy[off + j]);
            for (idx i = 0; i < P; ++i) {
                const float g0 = g[2 * i], g1 = g[2 * i + 1], z0 = z[2 * i], z1 = z[2 * i + 1];
                dz[2 * i] = g0 * c[i] + g1 * s[i];  // the rotation transposed
                dz[2 * i + 1] = g1 * c[i] - g0 * s[i];
                dc[i] += g0 * z0 + g1 * z1;
                ds[i] += g1 * z0 - g0 * z1;
            }
            if (a.u) {  // the reflection transposed (it is symmetric): dz - 2 (dz.u) u
                float dot = 0.0f;
                for (idx j = 0; j < D; ++j) dot += dz[j] * a.u[j];
                const float two_dot = 2.0f * dot;
                for (idx j = 0; j < D; ++j) dz[j] -= two_dot * a.u[j];
            }
            T* dxr = dx + off;
            for (idx j = 0; j < D; ++j) from_float(a.scale * dz[j] * dphi<K>(to_float(xr[j])), dxr + j);
        }
    }
}

#if defined(TN_AVX512)
// Vector path for D a multiple of 16 (the usual 64): a head row is D/16 registers; the cos/sin
// of a token are expanded once to lane pairs c2 = (c0, c0, c1, c1, ...), s2 = (-s0, s0, ...),
// so the rotation is z*c2 + swap(z)*s2 with swap exchanging the lanes of each pair.
constexpr int kMaxV = 16;  // D <= 256

inline __m512 swap_pairs(__m512 v) { return _mm512_permute_ps(v, 0xB1); }

template <int KERN>
inline __m512 phi16(__m512 v) {
    if (KERN == 0) return v;
    const __m512 zero = _mm512_setzero_ps();
    if (KERN == 3) return _mm512_max_ps(v, zero);
    const __mmask16 pos = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
    const __m512 em1 = tn::expm1_16(_mm512_min_ps(v, zero));
    const __m512 elu = _mm512_mask_blend_ps(pos, em1, v);
    return KERN == 1 ? elu : _mm512_add_ps(elu, _mm512_set1_ps(1.0f));
}

template <int KERN>
inline __m512 dphi16(__m512 v) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    if (KERN == 0) return one;
    const __mmask16 pos = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
    if (KERN == 3) return _mm512_mask_blend_ps(pos, zero, one);
    return _mm512_mask_blend_ps(pos, tn::exp16(_mm512_min_ps(v, zero)), one);
}

inline void expand_angles(const float* c, const float* s, idx P, float* c2, float* s2) {
    for (idx i = 0; i < P; ++i) {
        c2[2 * i] = c2[2 * i + 1] = c[i];
        s2[2 * i] = -s[i];
        s2[2 * i + 1] = s[i];
    }
}

// z = scale (phi(x) - 2 (phi(x).u) u) into registers zr[0..nv)
template <int KERN, typename T>
inline void reflect16(const Args& a, const T* x, int nv, __m512* zr) {
    __m512 dot = _mm512_setzero_ps();
    for (int v = 0; v < nv; ++v) {
        zr[v] = phi16<KERN>(tn::load16(x + 16 * v, 0xFFFF));
        if (a.u) dot = _mm512_fmadd_ps(zr[v], _mm512_loadu_ps(a.u + 16 * v), dot);
    }
    const __m512 sc = _mm512_set1_ps(a.scale);
    const __m512 m2dot = _mm512_set1_ps(-2.0f * _mm512_reduce_add_ps(dot));
    for (int v = 0; v < nv; ++v)
        zr[v] = _mm512_mul_ps(sc, a.u ? _mm512_fmadd_ps(m2dot, _mm512_loadu_ps(a.u + 16 * v), zr[v]) : zr[v]);
}

template <int KERN, typename T>
void forward_rows16(const Args& a, const T* x, T* y, idx r0, idx r1) {
    const idx H = a.H, D = a.D, P = D / 2;
    const int nv = int(D / 16);
    alignas(64) float c2[16 * kMaxV], s2[16 * kMaxV];
    __m512 zr[kMaxV];
    for (idx r = r0; r < r1; ++r) {
        expand_angles(a.cos + r * P, a.sin + r * P, P, c2, s2);
        for (idx h = 0; h < H; ++h) {
            const idx off = (r * H + h) * D;
            reflect16<KERN>(a, x + r * a.ldx + h * D, nv, zr);
            for (int v = 0; v < nv; ++v) {
                const __m512 out = _mm512_fmadd_ps(zr[v], _mm512_load_ps(c2 + 16 * v),
                                                   _mm512_mul_ps(swap_pairs(zr[v]), _mm512_load_ps(s2 + 16 * v)));
                tn::store16(y + off + 16 * v, out, 0xFFFF);
            }
        }
    }
}

template <int KERN, typename T>
void backward_rows16(const Args& a, const T* x, const T* dy, T* dx, float* dcos, float* dsin, idx r0, idx r1) {
    const idx H = a.H, D = a.D, P = D / 2;
    const int nv = int(D / 16);
    alignas(64) float c2[16 * kMaxV], s2[16 * kMaxV], acc_c[16 * kMaxV], acc_s[16 * kMaxV];
    __m512 zr[kMaxV], dz[kMaxV];
    for (idx r = r0; r < r1; ++r) {
        expand_angles(a.cos + r * P, a.sin + r * P, P, c2, s2);
        __m512 ac[kMaxV], as[kMaxV];
        for (int v = 0; v < nv; ++v) ac[v] = as[v] = _mm512_setzero_ps();
        for (idx h = 0; h < H; ++h) {
            const idx off = (r * H + h) * D;
            const T* xr = x + r * a.ldx + h * D;
            reflect16<KERN>(a, xr, nv, zr);
            __m512 dot = _mm512_setzero_ps();
            for (int v = 0; v < nv; ++v) {
                const __m512 g = tn::load16(dy + off + 16 * v, 0xFFFF), gs = swap_pairs(g);
                // the rotation transposed: dz_2i = g_2i c + g_2i+1 s, dz_2i+1 = g_2i+1 c - g_2i s
                dz[v] = _mm512_fnmadd_ps(gs, _mm512_load_ps(s2 + 16 * v), _mm512_mul_ps(g, _mm512_load_ps(c2 + 16 * v)));
                // per pair: dcos += g.z (both lanes), dsin += g_2i+1 z_2i - g_2i z_2i+1 (even lane)
                ac[v] = _mm512_fmadd_ps(g, zr[v], ac[v]);
                as[v] = _mm512_fmadd_ps(gs, zr[v], as[v]);
                if (a.u) dot = _mm512_fmadd_ps(dz[v], _mm512_loadu_ps(a.u + 16 * v), dot);
            }
            const __m512 sc = _mm512_set1_ps(a.scale);
            const __m512 m2dot = _mm512_set1_ps(-2.0f * _mm512_reduce_add_ps(dot));
            for (int v = 0; v < nv; ++v) {
                __m512 df = a.u ? _mm512_fmadd_ps(m2dot, _mm512_loadu_ps(a.u + 16 * v), dz[v]) : dz[v];
                df = _mm512_mul_ps(_mm512_mul_ps(sc, df), dphi16<KERN>(tn::load16(xr + 16 * v, 0xFFFF)));
                tn::store16(dx + off + 16 * v, df, 0xFFFF);
            }
        }
        for (int v = 0; v < nv; ++v) {
            // pair sums: lane 2i of ac + swap(ac) is g0 z0 + g1 z1; of as - swap(as) is g1 z0 - g0 z1
            _mm512_store_ps(acc_c + 16 * v, _mm512_add_ps(ac[v], swap_pairs(ac[v])));
            _mm512_store_ps(acc_s + 16 * v, _mm512_sub_ps(as[v], swap_pairs(as[v])));
        }
        for (idx i = 0; i < P; ++i) {
            dcos[r * P + i] = acc_c[2 * i];
            dsin[r * P + i] = acc_s[2 * i];
        }
    }
}
#endif

// Dispatch: the vector path when it applies, with the kernel as a template argument.
template <typename T>
void forward_any(const Args& a, const T* x, T* y, idx r0, idx r1) {
#if defined(TN_AVX512)
    if (a.D % 16 == 0 && a.D <= 16 * kMaxV) {
        switch (a.kern) {
            case 0: return forward_rows16<0>(a, x, y, r0, r1);
            case 1: return forward_rows16<1>(a, x, y, r0, r1);
            case 2: return forward_rows16<2>(a, x, y, r0, r1);
            default: return forward_rows16<3>(a, x, y, r0, r1);
        }
    }
#endif
    switch (a.kern) {
        case 0: return forward_rows<0>(a, x, y, r0, r1);
        case 1: return forward_rows<1>(a, x, y, r0, r1);
        case 2: return forward_rows<2>(a, x, y, r0, r1);
        default: return forward_rows<3>(a, x, y, r0, r1);
    }
}

template <typename T>
void backward_any(const Args& a, const T* x, const T* dy, T* dx, float* dcos, float* dsin, idx r0, idx r1) {
#if defined(TN_AVX512)
    if (a.D % 16 == 0 && a.D <= 16 * kMaxV) {
        switch (a.kern) {
            case 0: return backward_rows16<0>(a, x, dy, dx, dcos, dsin, r0, r1);
            case 1: return backward_rows16<1>(a, x, dy, dx, dcos, dsin, r0, r1);
            case 2: return backward_rows16<2>(a, x, dy, dx, dcos, dsin, r0, r1);
            default: return backward_rows16<3>(a, x, dy, dx, dcos, dsin, r0, r1);
        }
    }
#endif
    switch (a.kern) {
        case 0: return backward_rows<0>(a, x, dy, dx, dcos, dsin, r0, r1);
        case 1: return backward_rows<1>(a, x, dy, dx, dcos, dsin, r0, r1);
        case 2: return backward_rows<2>(a, x, dy, dx, dcos, dsin, r0, r1);
        default: return backward_rows<3>(a, x, dy, dx, dcos, dsin, r0, r1);
    }
}

bool bad(idx N, idx H, idx D, int kern) { return N < 0 || H < 1 || D < 2 || D % 2 || kern < 0 || kern > 3; }

}  // namespace

extern "C" {

#define TN_LRPE_DEFINE(SUFFIX, T)                                                                                  \
    int tn_lrpe_fwd_##SUFFIX(const void* x, void* y, const float* cos, const float* sin, const float* u, float scale, \
                             int kern, idx N, idx H, idx D, idx ldx, int nthreads) {                                 \
        if (bad(N, H, D, kern) || ldx < H * D) return 1;                                                             \
        const Args a{H, D, ldx, cos, sin, u, scale, kern};                                                                \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                             \
            forward_any(a, static_cast<const T*>(x), static_cast<T*>(y), r0, r1);                                  \
        });                                                                                                          \
        return 0;                                                                                                    \
    }                                                                                                                \
    int tn_lrpe_bwd_##SUFFIX(const void* x, const void* dy, void* dx, float* dcos, float* dsin, const float* cos,     \
                             const float* sin, const float* u, float scale, int kern, idx N, idx H, idx D,          \
                             idx ldx, int nthreads) {                                                                \
        if (bad(N, H, D, kern) || ldx < H * D) return 1;                                                             \
        const Args a{H, D, ldx, cos, sin, u, scale, kern};                                                                \
        tn::parallel_ranges(N, nthreads, [&](idx r0, idx r1) {                                                             \
            backward_any(a, static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), dcos, dsin,  \
                          r0, r1);                                                                                   \
        });                                                                                                          \
        return 0;                                                                                                    \
    }

TN_LRPE_DEFINE(f32, float)
TN_LRPE_DEFINE(bf16, bf16)

}  // extern "C"
