/* The CPU decoder layer's small operations in native code, for quanta.cpu.layer_ops: attention over the
 * paged KV cache, rotary with the KV store, RMSNorm with the residual add, SiLU-and-mul. Activations are float32.
 *
 * Batch invariance: every output row is computed from that row's inputs alone, by the same operations in the same
 * order whatever else is in the step (a decode, a prefill chunk, a recomputed token), and whatever the thread
 * count; threads only divide whole rows (or whole row-heads) between them. Built with -ffp-contract=off: a product
 * and a sum fuse only where v_fma / fmaf says, in every copy of a loop alike. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "../quant/ggml/half.h"

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2, CACHE_TABLE = 3 };

/* e^x (Cephes' expf: Cody-Waite reduction, a degree-6 polynomial, about 2 ulp), in plain operations that vectorize;
 * x is clamped to [-87.3, 88.3] */
static inline float exp_approx(float x) {
    x = x < -87.33654f ? -87.33654f : x > 88.37626f ? 88.37626f : x;
    float n = x * 1.44269504088896341f + 12582912.f;
    n = n - 12582912.f;                                         /* round to nearest */
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n; memcpy(&two_n, &bits, 4);
    return y * two_n;
}

/* float32 -> bfloat16 bits, round to nearest even (as torch's .to) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* The task's n rows of a cache (keys or values lo .. lo + n - 1 of KV head h) as float32 row pointers: into the cache
 * itself where it holds float32, else converted into buf [n, d] (fp8 codes through `table`, 256 values) */
static void cache_rows(const void *cache, int dtype, const int32_t *table, int64_t block_size, int64_t hk,
                       int64_t h, int64_t d, int64_t lo, int64_t n, const float *fp8, const float **rows, float *buf) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t key = lo + j, slot = (int64_t)table[key / block_size] * block_size + key % block_size;
        const int64_t at = (slot * hk + h) * d;
        if (dtype == CACHE_F32) { rows[j] = (const float *)cache + at; continue; }
        float *out = buf + j * d;
        rows[j] = out;
        if (dtype == CACHE_BF16) {
            const uint16_t *p = (const uint16_t *)cache + at;
            for (int64_t i = 0; i < d; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(out + i, &u, 4); }
        } else if (dtype == CACHE_F16) {
            const uint16_t *p = (const uint16_t *)cache + at;
            for (int64_t i = 0; i < d; i++) out[i] = from_f16(p[i]);
        } else {
            const uint8_t *p = (const uint8_t *)cache + at;
            for (int64_t i = 0; i < d; i++) out[i] = fp8[p[i]];
        }
    }
}

/* sum_i a[i] b[i]: lane-wise fused multiply-adds over whole vectors, the lanes' fixed tree, then the tail in order */
static inline float dot(const float *a, const float *b, int64_t n) {
    vf acc = v_zero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) acc = v_fma(v_load(a + i), v_load(b + i), acc);
    float s = v_sum(acc);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* acc [g, d] += sum_j p[a][j] v_j over the value rows j0 .. j1 - 1 for the g probability rows p (stride `padded`),
 * each lane's sum taking the keys in order with fused multiply-adds (a sum over all keys in pieces, piece after
 * piece, is the same sum). Two rows and four vectors of d at a time stay in registers (eight independent sums); what
 * d leaves over takes the same sums a lane at a time. */
static void weighted_sum(const float *const *v, const float *p, int64_t padded, int64_t j0, int64_t j1, int64_t g,
                         int64_t d, float *acc) {
    const int64_t wide = d / (4 * VL) * (4 * VL);
    for (int64_t a = 0; a < g; a += 2) {
        const int pair = a + 1 < g;
        const float *p0 = p + a * padded, *p1 = p + (pair ? a + 1 : a) * padded;
        for (int64_t c = 0; c < wide; c += 4 * VL) {
            float *o0 = acc + a * d + c, *o1 = acc + (pair ? a + 1 : a) * d + c;
            vf x0 = v_load(o0), x1 = v_load(o0 + VL), x2 = v_load(o0 + 2 * VL), x3 = v_load(o0 + 3 * VL);
            vf y0 = v_load(o1), y1 = v_load(o1 + VL), y2 = v_load(o1 + 2 * VL), y3 = v_load(o1 + 3 * VL);
            for (int64_t j = j0; j < j1; j++) {
                const float *r = v[j] + c;
                const vf b0 = v_set1(p0[j]), b1 = v_set1(p1[j]);
                const vf r0 = v_load(r), r1 = v_load(r + VL), r2 = v_load(r + 2 * VL), r3 = v_load(r + 3 * VL);
                x0 = v_fma(b0, r0, x0); x1 = v_fma(b0, r1, x1); x2 = v_fma(b0, r2, x2); x3 = v_fma(b0, r3, x3);
                y0 = v_fma(b1, r0, y0); y1 = v_fma(b1, r1, y1); y2 = v_fma(b1, r2, y2); y3 = v_fma(b1, r3, y3);
            }
            v_store(o0, x0); v_store(o0 + VL, x1); v_store(o0 + 2 * VL, x2); v_store(o0 + 3 * VL, x3);
            if (pair) { v_store(o1, y0); v_store(o1 + VL, y1); v_store(o1 + 2 * VL, y2); v_store(o1 + 3 * VL, y3); }
        }
        for (int64_t b = a; b < a + 2 && b < g; b++)
            for (int64_t i = wide; i < d; i++) {
                float s = acc[b * d + i];
                for (int64_t j = j0; j < j1; j++) s = fmaf(p[b * padded + j], v[j][i], s);
                acc[b * d + i] = s;
            }
    }
}

/* max of s[0 .. n - 1] (exact, so the order of the comparisons does not matter): VL running maxima, then theirs */
static inline float row_max(const float *s, int64_t n) {
    float m[VL];
    for (int l = 0; l < VL; l++) m[l] = s[0];
    int64_t j = 0;
    for (; j + VL <= n; j += VL)
        for (int l = 0; l < VL; l++) m[l] = s[j + l] > m[l] ? s[j + l] : m[l];
    for (; j < n; j++) m[0] = s[j] > m[0] ? s[j] : m[0];
    for (int l = 1; l < VL; l++) m[0] = m[l] > m[0] ? m[l] : m[0];
    return m[0];
}

/* The scores of `count` (at most N) query vectors qs + which[e] * d against a key tile [d, VL]: lane j of out[e] is
 * vector e's dot product with key j, summed over d in order with fused multiply-adds; the N sums run side by side
 * (a vector's sum is the same whichever others run beside it, or how many). */
#define TILE_SCORES(N)                                                                                          \
    static void tile_scores_##N(const float *tile, const float *qs, int64_t d, const int64_t *which,          \
                                int64_t count, float *out) {                                                  \
        vf s[N];                                                                                              \
        const float *q[N];                                                                                    \
        for (int e = 0; e < N; e++) { s[e] = v_zero(); q[e] = qs + which[e < count ? e : 0] * d; }            \
        for (int64_t i = 0; i < d; i++) {                                                                     \
            const vf k = v_load(tile + i * VL);                                                               \
            for (int e = 0; e < N; e++) s[e] = v_fma(v_set1(q[e][i]), k, s[e]);                              \
        }                                                                                                     \
        for (int e = 0; e < N && e < count; e++) v_store(out + e * VL, s[e]);                                \
    }
TILE_SCORES(4)
TILE_SCORES(8)

#define ROW_BLOCK 16         /* query rows of one sequence that share a transposed key tile */
#define KEY_PIECE 32         /* values a block's rows take in turn (in L1 for all of them) */

/* Attention of each query row t [hq, d] over keys row_lo[t] .. row_pos[t] of its sequence (row_seq[t], a row of
 * block_tables); a row with row_pos < 0 is padding and gets zeros. Per row and query head: scores q . k * scale
 * (q scaled first; each score one lane of a key tile, the sum over d in order with fused multiply-adds), their
 * maximum, p = e^(s - max), l = sum p (lanes by key index, a fixed tree), out = sum p v / l with the keys in order.
 * Rows come in blocks (blocks[i] .. blocks[i + 1]: consecutive rows of one sequence) that share the key tiles they
 * read; no row's numbers depend on its block. Caches [blocks, block_size, hk, d]; k_table / v_table [hk, 256] for
 * fp8 codes. */
void quanta_cpu_attention(const float *q, int64_t t_rows, int64_t hq, int64_t hk, int64_t d, float scale,
                          const void *k_cache, const void *v_cache, int dtype, int64_t block_size,
                          const int32_t *block_tables, int64_t table_width, const int32_t *row_seq,
                          const int32_t *row_pos, const int32_t *row_lo, const int32_t *blocks, int64_t n_blocks,
                          const float *k_table, const float *v_table, float *out, int threads) {
    (void)t_rows;
    const int64_t g = hq / hk, tasks = n_blocks * hk;
    #pragma omp parallel num_threads(threads)
    {
        int64_t cap = 0, rows_cap = 0;
        float *scores = NULL, *buf = NULL;
        const float **krows = NULL, **vrows = NULL;
        float *qs = malloc(sizeof(float) * ROW_BLOCK * g * d), *acc = malloc(sizeof(float) * ROW_BLOCK * g * d);
        float *inv = malloc(sizeof(float) * ROW_BLOCK * g), *tile = malloc(sizeof(float) * d * VL);
        float *lanes = malloc(sizeof(float) * ROW_BLOCK * g * VL);
        int64_t *seen = malloc(sizeof(int64_t) * ROW_BLOCK * g);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / hk, h = task % hk, t0 = blocks[b], rows = blocks[b + 1] - t0;
            int64_t first = -1, last = -1, span = 0;        /* the block's keys, and the longest row's */
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r;
                if (row_pos[t] < 0) { memset(out + (t * hq + h * g) * d, 0, sizeof(float) * g * d); continue; }
                if (first < 0 || row_lo[t] < first) first = row_lo[t];
                if (row_pos[t] > last) last = row_pos[t];
                if (row_pos[t] - row_lo[t] + 1 > span) span = row_pos[t] - row_lo[t] + 1;
            }
            if (first < 0) continue;
            const int64_t n = last - first + 1, padded = (span + VL - 1) / VL * VL;
            if (rows * g * padded > cap) {
                cap = rows * g * padded * 2; free(scores); scores = malloc(sizeof(float) * cap);
            }
            if (n > rows_cap) {
                rows_cap = n * 2;
                free(krows); free(vrows); free(buf);
                krows = malloc(sizeof(float *) * rows_cap); vrows = malloc(sizeof(float *) * rows_cap);
                buf = dtype == CACHE_F32 ? NULL : malloc(sizeof(float) * 2 * rows_cap * d);
            }
            const int32_t *table = block_tables + (int64_t)row_seq[t0] * table_width;
            cache_rows(k_cache, dtype, table, block_size, hk, h, d, first, n, k_table ? k_table + h * 256 : NULL,
                       krows, buf);
            cache_rows(v_cache, dtype, table, block_size, hk, h, d, first, n, v_table ? v_table + h * 256 : NULL,
                       vrows, buf ? buf + n * d : NULL);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < g * d; i++) qs[r * g * d + i] = q[(t0 + r) * hq * d + h * g * d + i] * scale;
            for (int64_t j0 = 0; j0 < n; j0 += VL) {            /* keys first + j0 .. as one tile [d, VL] */
                const int64_t width = n - j0 < VL ? n - j0 : VL;
                for (int64_t jj = 0; jj < VL; jj++) {
                    const float *k = krows[j0 + (jj < width ? jj : 0)];
                    for (int64_t i = 0; i < d; i++) tile[i * VL + jj] = k[i];
                }
                int64_t live = 0;                               /* the (row, head) vectors that see the tile */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t t = t0 + r, lo = row_lo[t] - first, hi = row_pos[t] - first;
                    if (row_pos[t] < 0 || hi < j0 || lo >= j0 + VL) continue;
                    for (int64_t a = 0; a < g; a++) seen[live++] = r * g + a;
                }
                for (int64_t v0 = 0; v0 < live; v0 += 8)
                    if (live - v0 > 4) tile_scores_8(tile, qs, d, seen + v0, live - v0, lanes + v0 * VL);
                    else tile_scores_4(tile, qs, d, seen + v0, live - v0, lanes + v0 * VL);
                for (int64_t e = 0; e < live; e++) {
                    const int64_t r = seen[e] / g, t = t0 + r, lo = row_lo[t] - first, hi = row_pos[t] - first;
                    float *row = scores + seen[e] * padded - lo;
                    for (int64_t jj = 0; jj < width; jj++)
                        if (j0 + jj >= lo && j0 + jj <= hi) row[j0 + jj] = lanes[e * VL + jj];
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r, m_keys = row_pos[t] - row_lo[t] + 1;
                if (row_pos[t] < 0) continue;
                const int64_t row_padded = (m_keys + VL - 1) / VL * VL;
                for (int64_t a = 0; a < g; a++) {
                    float *s = scores + (r * g + a) * padded;
                    const float m = row_max(s, m_keys);
                    for (int64_t j = 0; j < m_keys; j++) s[j] = exp_approx(s[j] - m);
                    for (int64_t j = m_keys; j < row_padded; j++) s[j] = 0.f;
                    vf lanes = v_zero();
                    for (int64_t j = 0; j < row_padded; j += VL) lanes = v_fma(v_load(s + j), v_set1(1.f), lanes);
                    inv[r * g + a] = 1.f / v_sum(lanes);
                }
            }
            memset(acc, 0, sizeof(float) * rows * g * d);
            for (int64_t c0 = 0; c0 < n; c0 += KEY_PIECE)         /* value rows c0 .. c0 + KEY_PIECE, row by row */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t t = t0 + r, lo = row_lo[t] - first, hi = row_pos[t] - first + 1;
                    if (row_pos[t] < 0 || hi <= c0 || lo >= c0 + KEY_PIECE) continue;
                    const int64_t j0 = (c0 > lo ? c0 : lo) - lo, j1 = (c0 + KEY_PIECE < hi ? c0 + KEY_PIECE : hi) - lo;
                    weighted_sum(vrows + lo, scores + r * g * padded, padded, j0, j1, g, d, acc + r * g * d);
                }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r;
                if (row_pos[t] < 0) continue;
                float *o = out + (t * hq + h * g) * d;
                for (int64_t a = 0; a < g; a++)
                    for (int64_t i = 0; i < d; i++) o[a * d + i] = acc[(r * g + a) * d + i] * inv[r * g + a];
            }
        }
        free(scores); free(buf); free(krows); free(vrows); free(qs); free(acc); free(inv); free(tile);
        free(lanes); free(seen);
    }
}

/* x rotated as rotary.rotate does it: x * cos + rotate_half(x) * sin, each product and the sum rounded on its own */
static inline void rotate(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + -x[i + half] * sin[i];
    for (int64_t i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static inline void store_row(void *cache, int dtype, int64_t at, const float *x, int64_t d) {
    if (dtype == CACHE_F32) { memcpy((float *)cache + at, x, sizeof(float) * d); return; }
    uint16_t *p = (uint16_t *)cache + at;
    for (int64_t i = 0; i < d; i++) p[i] = dtype == CACHE_BF16 ? float_to_bf16(x[i]) : to_f16(x[i]);
}

/* Rotary on the step's q and k, the rotated k and v stored in the paged caches at slots[t] (none where < 0): q, k, v
 * rows [t * row_stride + their offset], heads of d back to back; cos / sin [t_rows, d] float32; q_out [t, hq, d]. */
void quanta_cpu_rope_store(const float *q, const float *k, const float *v, int64_t t_rows, int64_t row_stride,
                           int64_t hq, int64_t hk, int64_t d, const float *cos, const float *sin, void *k_cache,
                           void *v_cache, int dtype, const int64_t *slots, float *q_out, int threads) {
    #pragma omp parallel num_threads(t_rows > 1 ? threads : 1)
    {
        float *row = malloc(sizeof(float) * d);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < t_rows; t++) {
            const float *c = cos + t * d, *sn = sin + t * d;
            for (int64_t h = 0; h < hq; h++) rotate(q + t * row_stride + h * d, c, sn, d, q_out + (t * hq + h) * d);
            if (slots[t] < 0) continue;
            for (int64_t h = 0; h < hk; h++) {
                rotate(k + t * row_stride + h * d, c, sn, d, row);
                store_row(k_cache, dtype, (slots[t] * hk + h) * d, row, d);
                store_row(v_cache, dtype, (slots[t] * hk + h) * d, v + t * row_stride + h * d, d);
            }
        }
        free(row);
    }
}

/* RMSNorm of each row: h = x (+ residual, rounded), y = w * (h / sqrt(mean(h^2) + eps)); h_out gets h where given */
void quanta_cpu_rms_norm(const float *x, const float *residual, const float *w, float eps, int64_t rows,
                         int64_t dim, float *y, float *h_out, int threads) {
    #pragma omp parallel num_threads(rows > 1 ? threads : 1)
    {
        float *h = malloc(sizeof(float) * dim);
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * dim;
            for (int64_t i = 0; i < dim; i++) h[i] = residual ? xr[i] + residual[r * dim + i] : xr[i];
            const float inv = 1.f / sqrtf(dot(h, h, dim) / (float)dim + eps);
            for (int64_t i = 0; i < dim; i++) y[r * dim + i] = w[i] * (h[i] * inv);
            if (h_out) memcpy(h_out + r * dim, h, sizeof(float) * dim);
        }
        free(h);
    }
}

/* silu(gate) * up for x rows [gate | up] of 2 * inter: gate / (1 + e^-gate) * up */
void quanta_cpu_silu_mul(const float *x, int64_t rows, int64_t inter, float *y, int threads) {
    #pragma omp parallel for num_threads(rows > 1 ? threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        for (int64_t i = 0; i < inter; i++) y[r * inter + i] = gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
    }
}
