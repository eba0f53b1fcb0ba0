/* y = x W^T on the CPU with W in ggml's blocks as the file stores them, for quanta.cpu.ggml.
 *
 * quanta_ggml_matmul(type, x, m, k, w, n, y, threads): x float32 [m, k], W n rows of k / QK blocks of `type`
 * (a ggml type id), y float32 [m, n]. A thread takes tiles of NR weight rows, dequantizes a tile's rows into a
 * float scratch (the values ggml's dequantize_row_* gives: built with -ffp-contract=off, every product and sum
 * rounds on its own as there) and multiplies them with every row of x.
 *
 * Batch invariance: y[i][j] is one dot product summed the same way whatever m, the tile and the thread count:
 * lane l of a VL-wide accumulator takes k = l, l + VL, ... in order with fused multiply-adds, and the lanes are
 * added in a fixed tree. Only the number of x rows a pass takes (MR or 1) differs, and it does not change the
 * arithmetic of any one product. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "../quant/ggml/half.h"

#define NR 4                /* weight rows a tile */
#define AHEAD 4             /* tiles ahead whose weight bytes are prefetched */
#define QK_K 256

static inline float f16(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);                                        /* exact, as from_f16 */
#else
    return from_f16(h);
#endif
}

#if !defined(__AVX512F__)                                      /* the AVX-512 path holds them in a register */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#endif

/* ---- one block -> its QK floats, as ggml-quants.c's dequantize_row_* ---- */

static inline void deq_q4_0(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b); const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = ((qs[j] & 0xF) - 8) * d;
    for (int j = 0; j < 16; j++) y[j + 16] = ((qs[j] >> 4) - 8) * d;
}

static inline void deq_q4_1(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b), m = f16(b + 2); const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) y[j] = (qs[j] & 0xF) * d + m;
    for (int j = 0; j < 16; j++) y[j + 16] = (qs[j] >> 4) * d + m;
}

static inline void deq_q5_0(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b); uint32_t qh; memcpy(&qh, b + 2, 4); const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10), hi = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = (lo - 16) * d; y[j + 16] = (hi - 16) * d;
    }
}

static inline void deq_q5_1(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b), m = f16(b + 2); uint32_t qh; memcpy(&qh, b + 4, 4); const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10), hi = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
        y[j] = lo * d + m; y[j + 16] = hi * d + m;
    }
}

static inline void deq_q8_0(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b); const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = qs[j] * d;
}

/* y[j] = d * KVALUES[low nibble of qs[j]], y[16 + j] = d * KVALUES[high nibble], j < 16 */
static inline void iq4_group(const uint8_t *restrict qs, float d, float *restrict y) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_set_ps(113, 89, 69, 53, 38, 25, 13, 1, -10, -22, -35, -49, -65, -83, -104, -127);
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)), low = _mm512_set1_epi32(15);
    const __m512 dv = _mm512_set1_ps(d);
    _mm512_storeu_ps(y, _mm512_mul_ps(dv, _mm512_permutexvar_ps(_mm512_and_si512(codes, low), table)));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(dv, _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table)));
#else
    for (int j = 0; j < 16; j++) y[j] = d * KVALUES[qs[j] & 0xF];
    for (int j = 0; j < 16; j++) y[j + 16] = d * KVALUES[qs[j] >> 4];
#endif
}

static inline void deq_iq4_nl(const uint8_t *restrict b, float *restrict y) { iq4_group(b + 2, f16(b), y); }

/* block_q2_K: scales[16] (scale | min << 4), qs[64], d, dmin */
static inline void deq_q2_K(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *sc = b, *q = b + 16;
    float d = f16(b + 80), dmin = f16(b + 82);
    int is = 0;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++) {
                float dl = d * (sc[is] & 0xF), ml = dmin * (sc[is] >> 4);
                is++;
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[l + 16 * half] >> shift) & 3) - ml;
            }
}

/* block_q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d */
static inline void deq_q3_K(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *hm = b, *q = b + 32;
    float d = f16(b + 108);
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & 0x0f0f0f0f) | (((tmp >> 4) & 0x03030303) << 4);
    aux[3] = ((aux[1] >> 4) & 0x0f0f0f0f) | (((tmp >> 6) & 0x03030303) << 4);
    aux[0] = (aux[0] & 0x0f0f0f0f) | (((tmp >> 0) & 0x03030303) << 4);
    aux[1] = (aux[1] & 0x0f0f0f0f) | (((tmp >> 2) & 0x03030303) << 4);
    const int8_t *scales = (const int8_t *)aux;
    int is = 0, m = 1;
    for (int n = 0; n < QK_K; n += 128, q += 32)
        for (int shift = 0; shift < 8; shift += 2, m <<= 1)
            for (int half = 0; half < 2; half++) {
                float dl = d * (scales[is++] - 32);
                for (int l = 16 * half; l < 16 * half + 16; l++)
                    *y++ = dl * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            }
}

/* the 6-bit scale and min j of a Q4_K / Q5_K block's 12 bytes (get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* block_q4_K: d, dmin, scales[12], qs[128] */
static inline void deq_q4_K(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int is = 0; is < 8; is += 2, q += 32) {
        int sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
    }
}

/* block_q5_K: d, dmin, scales[12], qh[32], qs[128] */
static inline void deq_q5_K(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int is = 0; is < 8; is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        int sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

/* block_q6_K: ql[128], qh[64], scales[16] (int8), d; each half of 128 holds four runs of 32: low nibbles of ql[0:32],
 * of ql[32:64], high nibbles of the same, with bits 0-1, 2-3, 4-5, 6-7 of qh[0:32] on top, a scale for each 16 */
static inline void deq_q6_K(const uint8_t *restrict b, float *restrict y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = f16(b + 208);
    for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8)
        for (int run = 0; run < 4; run++) {
            const uint8_t *low = ql + 32 * (run & 1);
            const int nib = 4 * (run >> 1), hb = 2 * run;
            for (int part = 0; part < 2; part++, y += 16) {
                float dl = d * sc[part + 2 * run];
                for (int l = 16 * part; l < 16 * part + 16; l++)
                    y[l - 16 * part] = dl * ((((low[l] >> nib) & 0xF) | (((qh[l] >> hb) & 3) << 4)) - 32);
            }
        }
}

/* block_iq4_xs: d, scales_h (2 bits a group), scales_l[4] (4 bits a group), qs[128] */
static inline void deq_iq4_xs(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b);
    uint16_t scales_h; memcpy(&scales_h, b + 2, 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, y += 32, qs += 16) {
        int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4);
        iq4_group(qs, d * (ls - 32), y);
    }
}

/* a whole row of blocks: the block's dequantization inlined into the loop (a call a block costs more than it) */
typedef void (*deq_row_fn)(const uint8_t *, float *, int64_t);
#define DEQ_ROW(type, qk, type_size)                                                                    \
    static void deq_row_##type(const uint8_t *restrict row, float *restrict y, int64_t blocks) {              \
        for (int64_t b = 0; b < blocks; b++) deq_##type(row + b * type_size, y + b * qk);              \
    }
DEQ_ROW(q4_0, 32, 18) DEQ_ROW(q4_1, 32, 20) DEQ_ROW(q5_0, 32, 22) DEQ_ROW(q5_1, 32, 24) DEQ_ROW(q8_0, 32, 34)
DEQ_ROW(q2_K, QK_K, 84) DEQ_ROW(q3_K, QK_K, 110) DEQ_ROW(q4_K, QK_K, 144) DEQ_ROW(q5_K, QK_K, 176)
DEQ_ROW(q6_K, QK_K, 210) DEQ_ROW(iq4_nl, 32, 18) DEQ_ROW(iq4_xs, QK_K, 136)

struct ggml_type { deq_row_fn deq_row; int qk, type_size; };

/* indexed by ggml's type ids (GGML_TYPE_Q4_0 = 2 ... GGML_TYPE_IQ4_XS = 23) */
static const struct ggml_type TYPES[24] = {
    [2] = {deq_row_q4_0, 32, 18}, [3] = {deq_row_q4_1, 32, 20}, [6] = {deq_row_q5_0, 32, 22},
    [7] = {deq_row_q5_1, 32, 24}, [8] = {deq_row_q8_0, 32, 34}, [10] = {deq_row_q2_K, QK_K, 84},
    [11] = {deq_row_q3_K, QK_K, 110}, [12] = {deq_row_q4_K, QK_K, 144}, [13] = {deq_row_q5_K, QK_K, 176},
    [14] = {deq_row_q6_K, QK_K, 210}, [20] = {deq_row_iq4_nl, 32, 18}, [23] = {deq_row_iq4_xs, QK_K, 136},
};

/* MR rows of x against the NR rows of w (row stride k) */
static inline void rows_mr(const float *x, int64_t k, const float *w, float *y, int64_t ldy) {
    vf acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) acc[i][r] = v_zero();
    for (int64_t c = 0; c < k; c += VL) {
        vf wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = v_load(w + r * k + c);
        for (int i = 0; i < MR; i++) {
            vf xv = v_load(x + i * k + c);
            for (int r = 0; r < NR; r++) acc[i][r] = v_fma(xv, wv[r], acc[i][r]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < NR; r++) y[i * ldy + r] = v_sum(acc[i][r]);
}

/* one row of x against the NR rows of w: the same sums as rows_mr */
static inline void rows_1(const float *x, int64_t k, const float *w, float *y) {
    vf acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = v_zero();
    for (int64_t c = 0; c < k; c += VL) {
        vf xv = v_load(x + c);
        for (int r = 0; r < NR; r++) acc[r] = v_fma(xv, v_load(w + r * k + c), acc[r]);
    }
    for (int r = 0; r < NR; r++) y[r] = v_sum(acc[r]);
}

/* one weight row r dequantized into out [k] (what a tile is made of) */
typedef void (*row_fn)(const void *ctx, int64_t r, float *out);

/* y [m, n] = x [m, k] W^T, W's rows made by `row` a tile of NR at a time; `bytes` + r * row_bytes is what row r
 * reads most of, prefetched AHEAD tiles ahead */
static void tiled_matmul(const float *x, int64_t m, int64_t k, int64_t n, float *y, int threads, row_fn row,
                         const void *ctx, const uint8_t *bytes, int64_t row_bytes) {
    const int64_t tiles = (n + NR - 1) / NR;
    #pragma omp parallel num_threads(threads)
    {
        float *wbuf = malloc(sizeof(float) * NR * k), out[MR * NR];
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * NR, nr = n - n0 < NR ? n - n0 : NR;
            if (tile + AHEAD < tiles) {                 /* the hardware prefetcher alone leaves DRAM mostly idle */
                const uint8_t *next = bytes + (n0 + AHEAD * NR) * row_bytes;
                const int64_t span = (n - n0 - AHEAD * NR < NR ? n - n0 - AHEAD * NR : NR) * row_bytes;
                for (int64_t at = 0; at < span; at += 64) __builtin_prefetch(next + at);
            }
            for (int r = 0; r < NR; r++)                /* a short last tile repeats its first row */
                row(ctx, n0 + (r < nr ? r : 0), wbuf + r * k);
            int64_t i = 0;
            for (; i + MR <= m; i += MR) {
                rows_mr(x + i * k, k, wbuf, out, NR);
                for (int a = 0; a < MR; a++) memcpy(y + (i + a) * n + n0, out + a * NR, sizeof(float) * nr);
            }
            for (; i < m; i++) {
                rows_1(x + i * k, k, wbuf, out);
                memcpy(y + i * n + n0, out, sizeof(float) * nr);
            }
        }
        free(wbuf);
    }
}

struct ggml_rows { const uint8_t *w; int64_t row_bytes, blocks; deq_row_fn deq; };

static void ggml_row(const void *ctx, int64_t r, float *out) {
    const struct ggml_rows *g = ctx;
    g->deq(g->w + r * g->row_bytes, out, g->blocks);
}

/* returns 0, or -1 for a type this file does not hold or a k that is not a whole number of blocks */
int quanta_ggml_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y,
                       int threads) {
    if (type < 0 || type >= 24 || TYPES[type].deq_row == NULL || k % TYPES[type].qk) return -1;
    const struct ggml_type t = TYPES[type];
    const struct ggml_rows rows = {w, k / t.qk * t.type_size, k / t.qk, t.deq_row};
    tiled_matmul(x, m, k, n, y, threads, ggml_row, &rows, w, rows.row_bytes);
    return 0;
}

/* Weights whose values are table[code] * scale: bitsandbytes NF4 / FP4 (4-bit codes two a byte, code 2j in the low
 * nibble; a scale a block of columns) and FP8 (a code a byte: table = the format's 256 values; a scale per tensor,
 * row or block). Row r, column c reads scale scales[(r / row_div) * row_mul + c / col_div]. */
struct lut_rows { const uint8_t *codes; int64_t k, row_bytes; int bits; const float *table, *scales;
                  int64_t row_div, row_mul, col_div; };

static void lut_row(const void *ctx, int64_t r, float *out) {
    const struct lut_rows *l = ctx;
    const uint8_t *codes = l->codes + r * l->row_bytes;
    const float *scales = l->scales + (r / l->row_div) * l->row_mul;
    for (int64_t c0 = 0; c0 < l->k; c0 += l->col_div) {
        const float s = scales[c0 / l->col_div];
        const int64_t c1 = c0 + l->col_div < l->k ? c0 + l->col_div : l->k;
        if (l->bits == 8) {
            for (int64_t c = c0; c < c1; c++) out[c] = l->table[codes[c]] * s;
        } else {                                        /* the block's 16 values, then a lookup a code */
            float scaled[16];
            for (int i = 0; i < 16; i++) scaled[i] = l->table[i] * s;
            for (int64_t c = c0; c < c1; c += 2) {
                const uint8_t b = codes[c / 2];
                out[c] = scaled[b & 15];
                out[c + 1] = scaled[b >> 4];
            }
        }
    }
}

/* returns 0, or -1 where k is not a whole number of vectors (or, for 4-bit codes, k or col_div is odd) */
int quanta_lut_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes, int bits, const float *table,
                      const float *scales, int64_t row_div, int64_t row_mul, int64_t col_div, int64_t n, float *y,
                      int threads) {
    if (k % VL || (bits == 4 && (k % 2 || col_div % 2))) return -1;
    const struct lut_rows rows = {codes, k, bits == 8 ? k : k / 2, bits, table, scales, row_div, row_mul, col_div};
    tiled_matmul(x, m, k, n, y, threads, lut_row, &rows, codes, rows.row_bytes);
    return 0;
}
