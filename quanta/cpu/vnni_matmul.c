/* y = x W^T on the CPU for 4- and 8-bit affine weights with 8-bit activations and integer dot products (AVX512-VNNI,
 * or AVX2's byte products: vnni_lanes.h), for quanta.cpu.vnni (which lays the weight out and says why).
 *
 * quanta_vnni_matmul(x, m, k, codes, bits, scales, group_blocks, mode, zero, offsets, tiles, y, n, threads):
 *   x float32 [m, k]; y float32 [m, n], n <= 16 tiles. The weight is tiles of 16 rows. For each tile and block j of
 *   32 columns, `codes` holds 32 bytes a row, interleaved so that one 64-byte vector is 4 codes of each of the 16
 *   rows (int32 lane r = row r): 8-bit codes as 8 such vectors (columns 4u .. 4u + 3 in vector u); 4-bit codes as 4
 *   vectors whose low nibbles are columns 8u .. 8u + 3 and high nibbles 8u + 4 .. 8u + 7. `scales` float16
 *   [tiles, groups, 16], a group `group_blocks` blocks; W = scale * (code - zero) where mode 0 has one zero for
 *   every group, mode 1 uint8 zeros [tiles, groups, 16] in `offsets`; W = scale * code + min with mode 2's float16
 *   mins [tiles, groups, 16].
 *
 * Activations: each row of x is quantized per block of 32 as llama.cpp does (d = max |x| / 127, codes rint(x * 127 /
 * max |x|), half to even), so y is W times those blocks: per block the products are summed exactly in int32 (the
 * zero's term too), and lane r accumulates d_w * d_x * sum (+ min * d_x * the codes' sum) in float32, blocks in
 * order. Batch invariance: y[i][v] depends on row i of x and row v of W alone, summed the same way whatever m, the
 * rows a pass takes and the thread count (threads take whole tiles). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vnni_lanes.h"

#if HAVE_VNNI
enum { ZERO_ONE = 0, ZERO_GROUPS = 1, MINS = 2 };

struct weight {
    const uint8_t *codes;
    const uint16_t *scales;
    const void *offsets;
    int64_t blocks, groups, group_blocks;
    int bits, mode, zero;
};

struct acts {                   /* x's 8-bit blocks: codes [m, k], d [m, blocks], the codes' sums [m, blocks] */
    const int8_t *q;
    const float *d;
    const int32_t *sum;
    int64_t k, blocks;
};

/* blocks ahead whose codes are prefetched: a thread's tiles are one contiguous stream, which the hardware
 * prefetcher alone leaves DRAM underused on */
#define AHEAD 16

/* the 8 code vectors of block j of a tile (vector u: 4 codes of every row, the columns of activation word u) */
static inline void block_codes(const struct weight *w, const uint8_t *tile, int64_t j, vi c[8]) {
    if (w->bits == 8) {
        const uint8_t *p = tile + j * 512;
        for (int u = 0; u < 8; u++) _mm_prefetch((const char *)(p + AHEAD * 512 + 64 * u), _MM_HINT_T0);
        for (int u = 0; u < 8; u++) c[u] = vi_load64(p + 64 * u);
        return;
    }
    const uint8_t *p = tile + j * 256;
    for (int u = 0; u < 4; u++) _mm_prefetch((const char *)(p + AHEAD * 256 + 64 * u), _MM_HINT_T0);
    for (int u = 0; u < 4; u++) {
        const vi v = vi_load64(p + 64 * u);
        c[2 * u] = vi_low_nibbles(v);
        c[2 * u + 1] = vi_high_nibbles(v);
    }
}

/* y[r][tile rows] for NR rows of x from row i0, over the whole of K; NR is a constant where this is inlined */
static inline __attribute__((always_inline)) void tile_rows(const struct weight *w, const struct acts *a,
                                                            int64_t t, int64_t i0, const int NR, vf acc[4]) {
    const uint8_t *tile = w->codes + t * w->blocks * (w->bits == 8 ? 512 : 256);
    const int64_t at = t * w->groups * 16;
    for (int r = 0; r < NR; r++) acc[r] = vf_set1(0.f);
    for (int64_t g = 0; g < w->groups; g++) {
        const vf s = vf_half16(w->scales + at + g * 16);
        vi zero = vi_set1(w->zero);
        vf mins = vf_set1(0.f);
        if (w->mode == ZERO_GROUPS)
            zero = vi_bytes16((const uint8_t *)w->offsets + at + g * 16);
        else if (w->mode == MINS)
            mins = vf_half16((const uint16_t *)w->offsets + at + g * 16);
        for (int64_t j = g * w->group_blocks; j < (g + 1) * w->group_blocks; j++) {
            vi c[8];
            block_codes(w, tile, j, c);
            for (int r = 0; r < NR; r++) {
                const int64_t row = i0 + r;
                const int32_t *xq = (const int32_t *)(a->q + row * a->k + 32 * j);
                vi dot = vi_set1(0);
                for (int u = 0; u < 8; u++)
                    dot = w->bits == 8 ? vi_dot4_wide(dot, c[u], xq[u]) : vi_dot4(dot, c[u], xq[u]);
                const float dx = a->d[row * a->blocks + j];
                const int32_t cs = a->sum[row * a->blocks + j];
                if (w->mode != MINS) dot = vi_sub(dot, vi_mullo(zero, vi_set1(cs)));
                acc[r] = vf_fma(vf_from_vi(dot), vf_mul(s, vf_set1(dx)), acc[r]);
                if (w->mode == MINS) acc[r] = vf_fma(mins, vf_set1(dx * (float)cs), acc[r]);
            }
        }
    }
}

static void tile(const struct weight *w, const struct acts *a, int64_t m, int64_t t, float *y, int64_t n) {
    vf acc[4];
    const int live = n - 16 * t < 16 ? (int)(n - 16 * t) : 16;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        tile_rows(w, a, t, i, 4, acc);
        for (int r = 0; r < 4; r++) vf_store(y + (i + r) * n + 16 * t, acc[r], live);
    }
    for (; i < m; i++) { tile_rows(w, a, t, i, 1, acc); vf_store(y + i * n + 16 * t, acc[0], live); }
}
#endif

/* the width in bits of the vectors this build computes with (512: AVX512-VNNI, 256: AVX2 with FMA and F16C), 0 where
 * it has no kernel */
int quanta_vnni_available(void) { return VECTOR_BITS; }

/* returns 0, or -1 where this build lacks the kernel or the arguments do not describe a weight it takes */
int quanta_vnni_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, int bits, const uint16_t *scales,
                       int64_t group_blocks, int mode, int zero, const void *offsets, int64_t tiles, float *y,
                       int64_t n, int threads) {
#if HAVE_VNNI
    if ((bits != 4 && bits != 8) || k % 32 || group_blocks < 1 || (k / 32) % group_blocks || mode < 0 || mode > 2
        || n > 16 * tiles || n <= 16 * (tiles - 1))
        return -1;
    const int64_t blocks = k / 32;
    const struct weight w = {codes, scales, offsets, blocks, blocks / group_blocks, group_blocks, bits, mode, zero};
    int8_t *q = malloc(m * k + 64);
    float *d = malloc(sizeof(float) * m * blocks + 64);
    int32_t *sum = malloc(sizeof(int32_t) * m * blocks + 64);
    if (!q || !d || !sum) { free(q); free(d); free(sum); return -1; }
    const struct acts a = {q, d, sum, k, blocks};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row(x + i * k, blocks, q + i * k, d + i * blocks, sum + i * blocks);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) tile(&w, &a, m, t, y, n);
    }
    free(q); free(d); free(sum);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)codes; (void)bits; (void)scales; (void)group_blocks; (void)mode; (void)zero;
    (void)offsets; (void)tiles; (void)y; (void)n; (void)threads;
    return -1;
#endif
}
