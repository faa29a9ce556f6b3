// What bounds the AMX attention kernels on this CPU: two measurements, one run, one thread.
//
//   g++ -O2 -march=native benchmarks/amx_tiles.cpp -o /tmp/amx_tiles && /tmp/amx_tiles
//
// 1. Where the operands live. A product C [64 x 32] = A [64 x 64] B [64 x 32] (M x N x K =
//    64 x 32 x 64: one forward score block, keys x queries over D = 64; 16 TDPBF16PS on 32 x 32
//    blocks of C) is repeated over 1, 64 or 512 distinct operand sets (12 KB each: L1, L2,
//    beyond L2), with C zeroed or loaded first, and with every operand either on a 64-byte
//    (cache-line) boundary or 16 bytes past one, where malloc puts a large block (then each
//    64-byte row of a tile load spans two lines).
// 2. Whether tile products overlap with AVX-512 work. The softmax kernels alternate the two (a
//    score block on tiles, then its exponentials in vectors). Timed: the tiles alone, an
//    exp-like vector pass alone, both in sequence, and both interleaved at a fine grain (what
//    software pipelining would do). If the units overlapped, "interleaved" would approach the
//    larger of the two alone.
// Needs an AMX CPU and Linux >= 5.16 (the tile state is requested with arch_prctl).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
const TileConfig kTiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

constexpr int kM = 64, kN = 32, kK = 64;  // A [kM x kK] bf16 (8 KB), B as VNNI pairs [kK/2 x kN] words (4 KB)

// One k-step (32) of one 32 x 32 block of C (blk 0 or 1 along M): q = 2 blk + step.
// Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B, as in src/transnormer/ops/_native_amx.h.
inline void block_step(const uint16_t* a, const uint32_t* b, float* c, int q, bool load_c) {
    const int blk = q / 2, k = (q % 2) * 32;
    float* cb = c + blk * 32 * kN;  // C [kM x kN] fp32, row stride kN
    if (k == 0) {
        if (load_c) {
            _tile_loadd(0, cb, kN * 4);
            _tile_loadd(1, cb + 16, kN * 4);
            _tile_loadd(2, cb + 16 * kN, kN * 4);
            _tile_loadd(3, cb + 16 * kN + 16, kN * 4);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
    }
    _tile_loadd(4, a + blk * 32 * kK + k, kK * 2);
    _tile_loadd(6, b + (k / 2) * kN, kN * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + (k / 2) * kN + 16, kN * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + (blk * 32 + 16) * kK + k, kK * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (k == 32) {
        _tile_stored(0, cb, kN * 4);
        _tile_stored(1, cb + 16, kN * 4);
        _tile_stored(2, cb + 16 * kN, kN * 4);
        _tile_stored(3, cb + 16 * kN + 16, kN * 4);
    }
}

// C = (or +=) A B: 2 blocks x 2 k-steps x 4 = 16 TDPBF16PS
inline void product(const uint16_t* a, const uint32_t* b, float* c, bool load_c) {
    for (int q = 0; q < 4; ++q) block_step(a, b, c, q, load_c);
}

// exp-like work on two rows of 32 floats (a degree-5 polynomial and a scale), as the kernels'
// exp2 of two score rows
inline __m512 vector_rows(const float* x, __m512 acc) {
    for (int u = 0; u < 2; ++u)
        for (int h = 0; h < 2; ++h) {
            const __m512 v = _mm512_loadu_ps(x + u * 32 + 16 * h);
            __m512 p = _mm512_fmadd_ps(v, _mm512_set1_ps(0.1f), _mm512_set1_ps(1.0f));
            for (int d = 0; d < 5; ++d) p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(0.5f));
            acc = _mm512_add_ps(acc, _mm512_scalef_ps(p, _mm512_roundscale_ps(v, 0)));
        }
    return acc;
}

// n elements of T, `offset` bytes past a cache line, every element `fill`
template <typename T>
struct Buffer {
    void* raw;
    T* p;
    Buffer(size_t n, size_t offset, T fill)
        : raw(std::aligned_alloc(64, (n * sizeof(T) + offset + 63) / 64 * 64)),
          p(reinterpret_cast<T*>(static_cast<char*>(raw) + offset)) {
        for (size_t i = 0; i < n; ++i) p[i] = fill;
    }
    ~Buffer() { std::free(raw); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
};

template <typename F>
double ns_per_call(long reps, F f) {
    for (long i = 0; i < reps / 10; ++i) f(i);
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < reps; ++i) f(i);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps * 1e9;
}

}  // namespace

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
        std::puts("AMX tile state not granted (no AMX, or Linux < 5.16)");
        return 1;
    }
    _tile_loadconfig(&kTiles);
    const long reps = 200000;

    std::puts("1. A 64x32x64 product (16 TDPBF16PS) over distinct operand sets");
    std::puts("| operand sets | resident in | C | ns / TDPBF16PS, 64-byte aligned | 16 bytes past a line |");
    std::puts("|---|---|---|---|---|");
    for (long sets : {1L, 64L, 512L})
        for (bool load_c : {false, true}) {
            double ns[2];
            for (int off = 0; off < 2; ++off) {
                Buffer<uint16_t> a(sets * kM * kK, 16 * off, 0x3f80);         // bf16 1.0
                Buffer<uint32_t> b(sets * kK / 2 * kN, 16 * off, 0x3f803f80);  // pairs of 1.0
                Buffer<float> c(kM * kN, 16 * off, 0.0f);
                ns[off] = ns_per_call(reps, [&](long i) {
                    const long s = i % sets;
                    product(a.p + s * kM * kK, b.p + s * kK / 2 * kN, c.p, load_c);
                });
            }
            std::printf("| %ld (%ld KB) | %s | %s | %.1f | %.1f |\n", sets, sets * 12,
                        sets == 1 ? "L1" : sets == 64 ? "L2" : "L3/DRAM", load_c ? "loaded" : "zeroed", ns[0] / 16,
                        ns[1] / 16);
        }

    Buffer<uint16_t> ab(kM * kK, 0, 0x3f80);
    Buffer<uint32_t> bb(kK / 2 * kN, 0, 0x3f803f80);
    Buffer<float> cb(kM * kN, 0, 0.0f), xb(64 * 32, 0, 0.0f);
    for (long i = 0; i < 64 * 32; ++i) xb.p[i] = 0.01f * float(i % 7);
    uint16_t* a = ab.p;
    uint32_t* b = bb.p;
    float *c = cb.p, *x = xb.p;
    __m512 acc = _mm512_setzero_ps();
    const double tiles = ns_per_call(reps, [&](long) { product(a, b, c, false); });
    const double vec = ns_per_call(reps, [&](long) {
        for (int r = 0; r < 64; r += 2) acc = vector_rows(x + r * 32, acc);
    });
    const double seq = ns_per_call(reps, [&](long) {
        product(a, b, c, false);
        for (int r = 0; r < 64; r += 2) acc = vector_rows(x + r * 32, acc);
    });
    const double inter = ns_per_call(reps, [&](long) {
        for (int r = 0; r < 64; r += 2) {
            if (r % 16 == 0) block_step(a, b, c, r / 16, false);
            acc = vector_rows(x + r * 32, acc);
        }
    });
    std::puts("\n2. Tile products against AVX-512 work (64 x 32 scores: 16 TDPBF16PS; their exp-like pass)");
    std::printf("tiles alone %.0f ns, vectors alone %.0f ns (sum %.0f), in sequence %.0f ns, interleaved %.0f ns\n",
                tiles, vec, tiles + vec, seq, inter);
    std::printf("interleaved / sum = %.2f (1.00: no overlap; max/sum = %.2f would be full overlap)\n",
                inter / (tiles + vec), (tiles > vec ? tiles : vec) / (tiles + vec));
    std::printf("(checksum %g)\n", double(_mm512_reduce_add_ps(acc)) + double(c[0]));
    _tile_release();
    return 0;
}
