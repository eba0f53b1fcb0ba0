/* ggml's quantizers (ggml-quants.c quantize_row_*_ref, what llama-quantize does without an imatrix, and for Q4_0,
 * Q5_0, Q4_K .. Q6_K the quantize_row_*_impl paths it takes with one) in plain C, for quanta.quant.ggml.native: the
 * same float32 operations in the same order as the torch quantizers in quantize.py / kquantize.py / qsearch.py, one
 * block at a time. Built with -ffp-contract=off and without fast-math, so every product and sum rounds on its own
 * as the C reference's do; the tests hold the two paths byte-identical.
 *
 * Entry points: quanta_quantize_<type>(x, out, nblocks) and, with importance weights qw shaped as x,
 * quanta_quantize_<type>_w(x, qw, out, nblocks, row_blocks): x holds nblocks blocks of the type's block size back to
 * back (whole rows of row_blocks blocks), out receives nblocks blocks of its type size. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#define GROUP_MAX_EPS 1e-15f
#define QK_K 256

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline void put_f16(uint8_t *p, float f) { uint16_t h = to_f16(f); memcpy(p, &h, 2); }
static inline float f16_at(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return from_f16(h); }

/* ggml nearest_int: round half to even through the 1.5 * 2^23 magic number (|v| < 2^22) */
static inline int nearest_int(float v) {
    float val = v + 12582912.f;
    int i; memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* sum of x^2 over n values, in index order (the reference's loop) */
static inline float sum_squares(const float *x, int64_t n) {
    float s = 0;
    for (int64_t j = 0; j < n; ++j) s += x[j] * x[j];
    return s;
}

/* the _impl paths' search weights from importance weights qw: qw * sqrt(sigma2 + x^2), sigma2 as each type makes it */
static inline void importance_weights(const float *x, const float *qw, float sigma2, int n, float *weights) {
    for (int j = 0; j < n; ++j) weights[j] = qw[j] * sqrtf(sigma2 + x[j] * x[j]);
}

/* --- scale searches ------------------------------------------------------------------------------------------ */
/* The searches run on a super-block's groups at once, each group's arithmetic exactly the reference's for one group
 * (every sum in element order): the groups are the lanes of [element][group] arrays, so the compiler's vectors and
 * the processor's pipelines work on independent groups instead of waiting on one group's running sums. */

/* make_qx_quants, rmse_type 1, on G groups of N at once (G <= 16, N <= 32): x [G groups][N], weights qw [G][N] or
 * NULL for x*x; symmetric levels L [G][N] in [0, 2*nmax), scales [G]. Inlined, so that each caller's constant G
 * and N shape its loops. */
static inline __attribute__((always_inline)) void make_qx_quants_lockstep(
        int G, int N, int nmax, const float *x, const float *qw, int8_t *L, float *scales) {
    float xt[32][16], wt[32][16], max[16], amax[16], iscale[16], best_iscale[16], sumlx[16], suml2[16], scale[16];
    float best[16];
    for (int i = 0; i < N; ++i)
        for (int g = 0; g < G; ++g) {
            xt[i][g] = x[N * g + i];
            wt[i][g] = qw ? qw[N * g + i] : xt[i][g] * xt[i][g];
        }
    for (int g = 0; g < G; ++g) { max[g] = 0; amax[g] = 0; }
    for (int i = 0; i < N; ++i)
        for (int g = 0; g < G; ++g) {
            float ax = fabsf(xt[i][g]);
            if (ax > amax[g]) { amax[g] = ax; max[g] = xt[i][g]; }
        }
    for (int is = 0; is <= 18; ++is) {            /* the first pass (nmax), then the trials -9 .. 9 without 0 */
        const int step = is == 0 ? 0 : (is <= 9 ? is - 10 : is - 9);
        for (int g = 0; g < G; ++g) {
            iscale[g] = is == 0 ? -nmax / max[g] : -(nmax + 0.1f * step) / max[g];
            sumlx[g] = 0;
            suml2[g] = 0;
        }
        for (int i = 0; i < N; ++i)
            for (int g = 0; g < G; ++g) {
                int l = nearest_int(iscale[g] * xt[i][g]);
                l = MAX(-nmax, MIN(nmax - 1, l));
                float w = wt[i][g];
                sumlx[g] += w * xt[i][g] * l;
                suml2[g] += w * l * l;
            }
        for (int g = 0; g < G; ++g) {
            if (is == 0) {
                scale[g] = suml2[g] ? sumlx[g] / suml2[g] : 0.0f;
                best[g] = scale[g] * sumlx[g];
                best_iscale[g] = iscale[g];
            } else if (suml2[g] > 0 && sumlx[g] * sumlx[g] > best[g] * suml2[g]) {
                scale[g] = sumlx[g] / suml2[g];
                best[g] = scale[g] * sumlx[g];
                best_iscale[g] = iscale[g];
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const int zero = amax[g] < GROUP_MAX_EPS;
        scales[g] = zero ? 0.f : scale[g];
        for (int i = 0; i < N; ++i) {
            int l = nearest_int(best_iscale[g] * xt[i][g]);
            L[N * g + i] = zero ? 0 : (int8_t)(nmax + MAX(-nmax, MIN(nmax - 1, l)));
        }
    }
}

/* make_qp_quants: levels L [n] in [0, nmax] (value L * scale) for the non-negative x [n] (a super-block's sub-block
 * scales or mins), weighted by qw, refined one element at a time */
static float make_qp_quants(int n, int nmax, const float *x, uint8_t *L, const float *qw) {
    float max = 0;
    for (int i = 0; i < n; ++i) max = MAX(max, x[i]);
    if (max < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = nmax / max, best_mse = 0;
    for (int i = 0; i < n; ++i) {
        const float diff = x[i] - (1 / iscale) * nearest_int(iscale * x[i]);
        best_mse += qw[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * is + nmax) / max, scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; ++i) {
            const float diff = x[i] - scale_is * MIN(nmax, nearest_int(iscale_is * x[i]));
            mse += qw[i] * diff * diff;
        }
        if (mse < best_mse) { best_mse = mse; iscale = iscale_is; }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        const int l = MIN(nmax, nearest_int(iscale * x[i]));
        L[i] = (uint8_t)l;
        sumlx += qw[i] * x[i] * l;
        suml2 += qw[i] * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            const float w = qw[i];
            float slx = sumlx - w * x[i] * L[i], sl2 = suml2 - w * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                const int new_l = MIN(nmax, nearest_int(x[i] * sl2 / slx));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0 ? sumlx / suml2 : 0.f;
}

/* make_q3_quants with do_rmse, one group of 16: symmetric levels L in [0, 2*nmax), refined one element at a time
 * (at most five passes, until one changes nothing) by x*x-weighted least squares */
static float make_q3_quants(int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < 16; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < 16; ++i) L[i] = 0;
        return 0.f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < 16; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAX(-nmax, MIN(nmax - 1, l));
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int changed = 0;
        for (int i = 0; i < 16; ++i) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = MAX(-nmax, MIN(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < 16; ++i) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0 ? sumlx / suml2 : 0.f;
}

/* make_qkx2_quants on G groups of N at once (G * N = 256, N <= 32, G <= 16): x, weights [G groups][N]; asymmetric
 * levels L [G][N] in [0, nmax], value L * scale - the_min; use_mad: absolute instead of squared errors */
/* (inlined, so that each caller's constant G and N shape its loops) */
static inline __attribute__((always_inline)) void make_qkx2_quants_lockstep(
        int G, int N, int nmax, const float *x, const float *weights, uint8_t *L, float *scales, float *the_mins,
        float rmin, float rdelta, int nstep, int use_mad) {
    float xt[32][16], wt[32][16], lt[32][16], best_l[32][16];
    float min[16], max[16], sum_w[16], sum_x[16], scale[16], best_error[16], iscale[16], start_min[16];
    float sum_l[16], sum_l2[16], sum_xl[16], D[16], this_scale[16], this_min[16], err[16];
    for (int i = 0; i < N; ++i)
        for (int g = 0; g < G; ++g) { xt[i][g] = x[N * g + i]; wt[i][g] = weights[N * g + i]; }
    for (int g = 0; g < G; ++g) {
        min[g] = max[g] = xt[0][g];
        sum_w[g] = wt[0][g];
        sum_x[g] = sum_w[g] * xt[0][g];
    }
    for (int i = 1; i < N; ++i)
        for (int g = 0; g < G; ++g) {
            if (xt[i][g] < min[g]) min[g] = xt[i][g];
            if (xt[i][g] > max[g]) max[g] = xt[i][g];
            sum_w[g] += wt[i][g];
            sum_x[g] += wt[i][g] * xt[i][g];
        }
    for (int g = 0; g < G; ++g) {
        if (min[g] > 0) min[g] = 0;
        start_min[g] = min[g];
        iscale[g] = nmax / (max[g] - min[g]);      /* a flat group (max == min) is settled at the end */
        scale[g] = 1 / iscale[g];
        best_error[g] = 0;
    }
    for (int i = 0; i < N; ++i)
        for (int g = 0; g < G; ++g) {
            int l = nearest_int(iscale[g] * (xt[i][g] - min[g]));
            best_l[i][g] = (float)MAX(0, MIN(nmax, l));
            float diff = scale[g] * best_l[i][g] + min[g] - xt[i][g];
            best_error[g] += wt[i][g] * (use_mad ? fabsf(diff) : diff * diff);
        }
    for (int is = 0; is <= nstep; ++is) {
        for (int g = 0; g < G; ++g) {
            iscale[g] = (rmin + rdelta * is + nmax) / (max[g] - min[g]);
            sum_l[g] = sum_l2[g] = sum_xl[g] = 0;
        }
        for (int i = 0; i < N; ++i)
            for (int g = 0; g < G; ++g) {
                int l = nearest_int(iscale[g] * (xt[i][g] - min[g]));
                lt[i][g] = (float)MAX(0, MIN(nmax, l));
                float w = wt[i][g];
                sum_l[g] += w * lt[i][g];
                sum_l2[g] += w * lt[i][g] * lt[i][g];
                sum_xl[g] += w * lt[i][g] * xt[i][g];
            }
        for (int g = 0; g < G; ++g) {
            D[g] = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D[g];
            this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D[g];
            if (this_min[g] > 0) {
                this_min[g] = 0;
                this_scale[g] = sum_xl[g] / sum_l2[g];
            }
            err[g] = 0;
        }
        for (int i = 0; i < N; ++i)
            for (int g = 0; g < G; ++g) {
                float diff = this_scale[g] * lt[i][g] + this_min[g] - xt[i][g];
                err[g] += wt[i][g] * (use_mad ? fabsf(diff) : diff * diff);
            }
        for (int g = 0; g < G; ++g) {
            if (D[g] > 0 && err[g] < best_error[g]) {
                for (int i = 0; i < N; ++i) best_l[i][g] = lt[i][g];
                best_error[g] = err[g];
                scale[g] = this_scale[g];
                min[g] = this_min[g];
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const int flat = max[g] == start_min[g];
        scales[g] = flat ? 0.f : scale[g];
        the_mins[g] = -(flat ? start_min[g] : min[g]);
        for (int i = 0; i < N; ++i) L[N * g + i] = flat ? 0 : (uint8_t)best_l[i][g];
    }
}

/* --- legacy 32-element types --------------------------------------------------------------------------------- */
/* the signed value of the first element of largest magnitude (the reference's `if (amax < fabsf(v))`) */
static inline float signed_absmax(const float *restrict x) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
        const float v = x[j], a = fabsf(v);
        if (amax < a) { amax = a; max = v; }
    }
    return max;
}

/* Q4_0 / Q5_0 codes of one block: MIN(top, (int8_t)(x * id + offset)) */
static inline void symmetric_codes(const float *restrict x, float id, float offset, int top, uint8_t *restrict q) {
    for (int j = 0; j < 32; ++j) q[j] = (uint8_t)MIN(top, (int8_t)(x[j] * id + offset));
}

/* 32 codes' low nibbles, element j in the low half of byte j and element j + 16 in the high half */
static inline void pack_nibbles(const uint8_t *restrict q, uint8_t *restrict qs) {
    for (int j = 0; j < 16; ++j) qs[j] = (q[j] & 0x0F) | (uint8_t)((q[16 + j] & 0x0F) << 4);
}

/* 32 codes' fifth bits as a little-endian u32, bit j of element j */
static inline void pack_fifth_bits(const uint8_t *restrict q, uint8_t *restrict qh) {
    uint32_t bits = 0;
    for (int j = 0; j < 32; ++j) bits |= (uint32_t)((q[j] >> 4) & 1) << j;
    memcpy(qh, &bits, 4);
}

void quanta_quantize_q4_0(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    uint8_t q[32];
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 18) {
        const float d = signed_absmax(x) / -8, id = d ? 1.0f / d : 0.0f;
        put_f16(out, d);
        symmetric_codes(x, id, 8.5f, 15, q);
        pack_nibbles(q, out + 2);
    }
}

void quanta_quantize_q5_0(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    uint8_t q[32];
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 22) {
        const float d = signed_absmax(x) / -16, id = d ? 1.0f / d : 0.0f;
        put_f16(out, d);
        symmetric_codes(x, id, 16.5f, 31, q);
        pack_fifth_bits(q, out + 2);
        pack_nibbles(q, out + 6);
    }
}

/* Q4_1 / Q5_1: d = (max - min) / nmax and min in the block's first 4 bytes; codes (uint8_t)((x - min) * id + 0.5f),
 * Q4_1's through int8_t and MIN(15, .) as the reference writes it */
static void min_scale_codes(const float *restrict x, int nmax, uint8_t *restrict head, uint8_t *restrict q) {
    float min = INFINITY, max = -INFINITY;
    for (int j = 0; j < 32; ++j) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / nmax, id = d ? 1.0f / d : 0.0f;
    put_f16(head, d);
    put_f16(head + 2, min);
    for (int j = 0; j < 32; ++j) {
        const float v = (x[j] - min) * id + 0.5f;
        q[j] = nmax == 15 ? (uint8_t)MIN(15, (int8_t)v) : (uint8_t)v;
    }
}

void quanta_quantize_q4_1(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    uint8_t q[32];
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 20) {
        min_scale_codes(x, 15, out, q);
        pack_nibbles(q, out + 4);
    }
}

void quanta_quantize_q5_1(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    uint8_t q[32];
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 24) {
        min_scale_codes(x, 31, out, q);
        pack_fifth_bits(q, out + 4);
        pack_nibbles(q, out + 8);
    }
}

void quanta_quantize_q8_0(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 34) {
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = MAX(amax, fabsf(x[j]));
        const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
        put_f16(out, d);
        for (int j = 0; j < 32; ++j) {                      /* roundf: half away from zero */
            const float v = x[j] * id;
            int q = (int)v;                                 /* |v| <= 127: the cast truncates, v - q is exact */
            const float frac = v - (float)q;
            q += (frac >= 0.5f) - (frac <= -0.5f);
            out[2 + j] = (uint8_t)(int8_t)q;
        }
    }
}

/* --- K-quants ------------------------------------------------------------------------------------------------ */
/* Q4_K / Q5_K's head (d, dmin, the 12 bytes of 6-bit scales ls and mins lm) and the final levels L from them */
static void affine_k_finish(const float *x, uint8_t *head, uint8_t *L, int nmax, const uint8_t *ls, const uint8_t *lm,
                            float d_block, float m_block) {
    uint8_t *sc = head + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < QK_K / 32; ++j) {
        if (j < 4) {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (ls[j] & 0xF) | (uint8_t)((lm[j] & 0xF) << 4);
            sc[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            sc[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    put_f16(head, d_block);
    put_f16(head + 2, m_block);
    const float dd = f16_at(head), dmin = f16_at(head + 2);
    for (int j = 0; j < QK_K / 32; ++j) {
        const float d = dd * ls[j];
        if (!d) continue;
        const float dm = dmin * lm[j];
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)MAX(0, MIN(nmax, l));
        }
    }
}

/* Q4_K / Q5_K without weights: eight sub-blocks of 32 searched with weights av_x + |x|, their scales and mins
 * rounded to 6 bits of the largest */
static void affine_k(const float *x, uint8_t *head, uint8_t *L, int nmax, float rmin, int nstep) {
    float weights[QK_K], mins[QK_K / 32], scales[QK_K / 32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float av_x = sqrtf(sum_squares(x + 32 * j, 32) / 32);
        for (int l = 0; l < 32; ++l) weights[32 * j + l] = av_x + fabsf(x[32 * j + l]);
    }
    make_qkx2_quants_lockstep(8, 32, nmax, x, weights, L, scales, mins, rmin, 0.1f, nstep, 0);
    for (int j = 0; j < QK_K / 32; ++j) {
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < QK_K / 32; ++j) {
        ls[j] = MIN(63, (uint8_t)nearest_int(inv_scale * scales[j]));
        lm[j] = MIN(63, (uint8_t)nearest_int(inv_min * mins[j]));
    }
    affine_k_finish(x, head, L, nmax, ls, lm, max_scale / 63.f, max_min / 63.f);
}

/* Q4_K / Q5_K with importance weights qw (quantize_row_q*_K_impl): weights qw * sqrt(sigma2 + x^2), the search's
 * wider trials, and the scales and mins fitted by make_qp_quants weighted by each sub-block's weight sum */
static void affine_k_weighted(const float *x, const float *qw, uint8_t *head, uint8_t *L, int nmax) {
    float weights[QK_K], mins[QK_K / 32], scales[QK_K / 32], sw[QK_K / 32];
    const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
    importance_weights(x, qw, sigma2, QK_K, weights);
    for (int j = 0; j < QK_K / 32; ++j) {
        float sumw = 0;
        for (int l = 0; l < 32; ++l) sumw += weights[32 * j + l];
        sw[j] = sumw;
    }
    make_qkx2_quants_lockstep(8, 32, nmax, x, weights, L, scales, mins, -0.9f, 0.05f, 36, 0);
    uint8_t ls[8], lm[8];
    const float d_block = make_qp_quants(8, 63, scales, ls, sw);
    const float m_block = make_qp_quants(8, 63, mins, lm, sw);
    affine_k_finish(x, head, L, nmax, ls, lm, d_block, m_block);
}

/* 256 2-bit levels (of Q2_K, or Q3_K's low bits) four to a byte: byte l of each 32 holds elements l, l + 32, l + 64,
 * l + 96 of its 128 */
static void pack_2bit(const void *levels, uint8_t *qs) {
    const uint8_t *L = levels;
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* Q2_K: sixteen sub-blocks of 16, 2-bit levels, 4-bit scales and mins (weights |x|, absolute errors) */
void quanta_quantize_q2_K(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    uint8_t L[QK_K];
    float weights[QK_K], mins[16], scales[16];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 84) {
        for (int l = 0; l < QK_K; ++l) weights[l] = fabsf(x[l]);
        make_qkx2_quants_lockstep(16, 16, 3, x, weights, L, scales, mins, -0.5f, 0.1f, 15, 1);
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; ++j) {
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        uint8_t *sc = out, *qs = out + 16;
        memset(sc, 0, 16);
        if (max_scale > 0) {
            const float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; ++j) sc[j] = (uint8_t)nearest_int(iscale * scales[j]);
        }
        put_f16(out + 80, max_scale > 0 ? max_scale / 15.f : 0.f);
        if (max_min > 0) {
            const float iscale = 15.f / max_min;
            for (int j = 0; j < 16; ++j) sc[j] |= (uint8_t)(nearest_int(iscale * mins[j]) << 4);
        }
        put_f16(out + 82, max_min > 0 ? max_min / 15.f : 0.f);
        const float dd = f16_at(out + 80), dmin = f16_at(out + 82);
        for (int j = 0; j < 16; ++j) {
            const float d = dd * (sc[j] & 0xF);
            if (!d) continue;
            const float dm = dmin * (sc[j] >> 4);
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int((x[16 * j + ii] + dm) / d);
                L[16 * j + ii] = (uint8_t)MAX(0, MIN(3, l));
            }
        }
        pack_2bit(L, qs);
    }
}

/* Q3_K: sixteen sub-blocks of 16, 3-bit levels (2 low bits and hmask), 6-bit signed scales */
void quanta_quantize_q3_K(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    int8_t L[QK_K];
    float scales[16];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 110) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; ++j) {
            scales[j] = make_q3_quants(4, x + 16 * j, L + 16 * j);
            const float scale = fabsf(scales[j]);
            if (scale > amax) { amax = scale; max_scale = scales[j]; }
        }
        uint8_t *hmask = out, *qs = out + 32, *sc = out + 96;
        memset(sc, 0, 12);
        int8_t ls[16] = {0};
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; ++j) {
                const int l = MAX(-32, MIN(31, (int8_t)nearest_int(iscale * scales[j]))) + 32;
                ls[j] = (int8_t)(l - 32);
                if (j < 8) sc[j] = (uint8_t)(l & 0xF); else sc[j - 8] |= (uint8_t)((l & 0xF) << 4);
                sc[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            put_f16(out + 108, 1 / iscale);
        } else {
            put_f16(out + 108, 0.f);
        }
        const float dd = f16_at(out + 108);
        for (int j = 0; j < 16; ++j) {
            const float d = dd * ls[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(MAX(-4, MIN(3, l)) + 4);
            }
        }
        memset(hmask, 0, 32);
        for (int j = 0; j < QK_K; ++j) {
            if (L[j] > 3) { hmask[j % 32] |= (uint8_t)(1 << (j / 32)); L[j] -= 4; }
        }
        pack_2bit(L, qs);
    }
}

/* Q4_K: eight sub-blocks of 32, 4-bit levels, 6-bit scales and mins; qw: importance weights or NULL */
static void q4_K_blocks(const float *x, const float *qw, uint8_t *out, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 144) {
        if (qw) affine_k_weighted(x, qw + QK_K * i, out, L, 15); else affine_k(x, out, L, 15, -1.f, 20);
        uint8_t *q = out + 16;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (uint8_t)(L[j + l + 32] << 4);
    }
}

/* Q5_K: as Q4_K with 5-bit levels (the fifth bits in qh) */
static void q5_K_blocks(const float *x, const float *qw, uint8_t *out, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 176) {
        if (qw) affine_k_weighted(x, qw + QK_K * i, out, L, 31); else affine_k(x, out, L, 31, -0.5f, 15);
        uint8_t *qh = out + 16, *ql = out + 48, m1 = 1, m2 = 2;
        memset(qh, 0, QK_K / 8);
        for (int n = 0; n < QK_K; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j], l2 = L[n + j + 32];
                if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

/* Q6_K: sixteen sub-blocks of 16, 6-bit levels, int8 scales; qw: importance weights (used as they are) or NULL */
static void q6_K_blocks(const float *x, const float *qw, uint8_t *out, int64_t nb) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 210) {
        float max_scale = 0, max_abs_scale = 0;
        make_qx_quants_lockstep(16, 16, 32, x, qw ? qw + QK_K * i : NULL, L, scales);
        for (int ib = 0; ib < QK_K / 16; ++ib) {
            const float abs_scale = fabsf(scales[ib]);
            if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scales[ib]; }
        }
        memset(out, 0, 210);
        if (max_abs_scale < GROUP_MAX_EPS) continue;
        int8_t *sc = (int8_t *)(out + 192);
        float iscale = -128.f / max_scale;
        put_f16(out + 208, 1 / iscale);
        const float dd = f16_at(out + 208);
        for (int ib = 0; ib < QK_K / 16; ++ib) sc[ib] = (int8_t)MIN(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < QK_K / 16; ++j) {
            const float d = dd * sc[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(MAX(-32, MIN(31, l)) + 32);
            }
        }
        uint8_t *ql = out, *qh = out + 128;
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = q1 | (uint8_t)(q3 << 4);
                ql[l + 32] = q2 | (uint8_t)(q4 << 4);
                qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                                  | ((L[j + l + 96] >> 4) << 6));
            }
        }
    }
}

/* --- IQ4_NL / IQ4_XS: the 16 non-uniform levels ----------------------------------------------------------- */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ABOVE[floor(v) + 128]: the index of the first level above floor(v), clamped to [1, 15]; the levels are integers,
 * so the two levels around v depend on floor(v) alone */
static uint8_t ABOVE[256];

__attribute__((constructor)) static void make_above(void) {
    for (int f = -128; f < 128; ++f) {
        int above = 0;
        while (above < 16 && KVALUES[above] <= f) ++above;
        ABOVE[f + 128] = (uint8_t)MAX(1, MIN(15, above));
    }
}

/* ggml best_index_int8: the index of the level nearest v (the lower one only when strictly nearer), clamped to the
 * ends */
static inline int nearest_level(float v) {
    if (!(v < KVALUES[15])) return 15;                  /* NaN too (a group whose weights are all 0): as ggml */
    if (v <= KVALUES[0]) return 0;
    int f = (int)v;                                     /* floor: the cast truncates toward zero */
    f -= (float)f > v;
    const int hi = ABOVE[f + 128];
    return v - KVALUES[hi - 1] < KVALUES[hi] - v ? hi - 1 : hi;
}

/* one group of 32's scale by the 15-trial weighted least squares (weights, or x^2 where NULL), 0 for an empty
 * group */
static float iq4_group_scale(const float *x, const float *weights) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
        const float ax = fabsf(x[j]);
        if (ax > amax) { amax = ax; max = x[j]; }
    }
    if (amax < GROUP_MAX_EPS) return 0.f;
    float d = -max / KVALUES[0], best = 0;
    for (int itry = -8; itry <= 7; ++itry) {               /* -8: the first pass at 1/d; then -7 .. 7 */
        const float id = itry == -8 ? 1 / d : (itry + KVALUES[0]) / max;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; ++j) {
            const float q = KVALUES[nearest_level(id * x[j])], w = weights ? weights[j] : x[j] * x[j];
            sumqx += w * q * x[j];
            sumq2 += w * q * q;
        }
        if (itry == -8) {
            d = sumqx / sumq2;
            best = d * sumqx;
        } else if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

/* IQ4's search weights: sigma2 = (sum of x^2 over the n values) * (2 / n) */
static void iq4_weights(const float *x, const float *qw, int n, float *weights) {
    importance_weights(x, qw, sum_squares(x, n) * (2.f / n), n, weights);
}

static void iq4_nl_blocks(const float *x, const float *qw, uint8_t *out, int64_t nb) {
    float weights[32];
    for (int64_t i = 0; i < nb; ++i, x += 32, out += 18) {
        if (qw) iq4_weights(x, qw + 32 * i, 32, weights);
        const float d = iq4_group_scale(x, qw ? weights : NULL), id = d ? 1 / d : 0.f;
        put_f16(out, d);
        for (int j = 0; j < 16; ++j)
            out[2 + j] = (uint8_t)(nearest_level(id * x[j]) | (nearest_level(id * x[16 + j]) << 4));
    }
}

static void iq4_xs_blocks(const float *x, const float *qw, uint8_t *out, int64_t nb) {
    float scales[8], weights[QK_K];
    for (int64_t i = 0; i < nb; ++i, x += QK_K, out += 136) {
        float max_scale = 0, amax_scale = 0;
        if (qw) iq4_weights(x, qw + QK_K * i, QK_K, weights);
        for (int ib = 0; ib < 8; ++ib) {
            scales[ib] = iq4_group_scale(x + 32 * ib, qw ? weights + 32 * ib : NULL);
            if (fabsf(scales[ib]) > amax_scale) { amax_scale = fabsf(scales[ib]); max_scale = scales[ib]; }
        }
        const float d = -max_scale / 32, id = d ? 1 / d : 0.f;
        put_f16(out, d);
        uint16_t scales_h = 0;
        uint8_t *scales_l = out + 4, *q = out + 8;
        memset(scales_l, 0, 4);
        for (int ib = 0; ib < 8; ++ib) {
            int l = MAX(-32, MIN(31, nearest_int(id * scales[ib])));
            const float dl = d * l, idl = dl ? 1 / dl : 0.f;
            const float *xb = x + 32 * ib;
            for (int j = 0; j < 16; ++j)
                q[16 * ib + j] = (uint8_t)(nearest_level(idl * xb[j]) | (nearest_level(idl * xb[16 + j]) << 4));
            l += 32;
            scales_l[ib / 2] |= (uint8_t)((l & 0xF) << (4 * (ib % 2)));
            scales_h |= (uint16_t)((l >> 4) << (2 * ib));
        }
        memcpy(out + 2, &scales_h, 2);
    }
}

/* The legacy types with weights (quantize_row_q*_impl): per row, sigma2 = mean x^2 over the row; each block's search
 * weighted by qw * sqrt(sigma2 + x^2): make_qx_quants for Q4_0 / Q5_0 (a scale), the wider qkx search for Q4_1 /
 * Q5_1 (a scale and a min). A block is d, [the min], [the fifth bits], the nibbles, as the type has them. */
static void legacy_weighted(const float *x, const float *qw, uint8_t *out, int64_t nb, int64_t row_blocks, int nmax,
                            int has_min, int type_size) {
    uint8_t L[32];
    float weights[32], d, the_min;
    for (int64_t row = 0; row < nb; row += row_blocks) {
        const float sigma2 = sum_squares(x, 32 * row_blocks) / (32 * row_blocks);
        for (int64_t b = 0; b < row_blocks; ++b, x += 32, qw += 32, out += type_size) {
            importance_weights(x, qw, sigma2, 32, weights);
            uint8_t *at = out + 2;
            if (has_min) {
                make_qkx2_quants_lockstep(1, 32, nmax, x, weights, L, &d, &the_min, -0.9f, 0.05f, 36, 0);
                put_f16(at, -the_min);
                at += 2;
            } else {
                make_qx_quants_lockstep(1, 32, nmax, x, weights, (int8_t *)L, &d);
            }
            put_f16(out, d);
            if (nmax >= 16) {                           /* 5-bit codes: Q5_0 (levels to 2 * 16), Q5_1 (to 31) */
                pack_fifth_bits(L, at);
                at += 4;
            }
            pack_nibbles(L, at);
        }
    }
}

/* --- entry points ---------------------------------------------------------------------------------------------- */
/* without weights: quanta_quantize_<type>(x, out, nblocks); with importance weights qw (same shape as x):
 * quanta_quantize_<type>_w(x, qw, out, nblocks, row_blocks), nblocks a whole number of rows of row_blocks blocks.
 * (The legacy types without weights are defined with their blocks above.) */

/* a type whose blocks need nothing from the rest of their row: <type>_blocks(x, qw or NULL, out, nblocks) */
#define BLOCKWISE_ENTRY_POINTS(type)                                                                           \
    void quanta_quantize_##type(const float *x, uint8_t *out, int64_t nb) { type##_blocks(x, NULL, out, nb); } \
    void quanta_quantize_##type##_w(const float *x, const float *qw, uint8_t *out, int64_t nb,                \
                                    int64_t row_blocks) {                                                     \
        (void)row_blocks;                                                                                      \
        type##_blocks(x, qw, out, nb);                                                                         \
    }

BLOCKWISE_ENTRY_POINTS(q4_K)
BLOCKWISE_ENTRY_POINTS(q5_K)
BLOCKWISE_ENTRY_POINTS(q6_K)
BLOCKWISE_ENTRY_POINTS(iq4_nl)
BLOCKWISE_ENTRY_POINTS(iq4_xs)

/* the legacy types' weighted paths take sigma2 over a whole row: (nmax, has a min, type size) each */
#define LEGACY_WEIGHTED_ENTRY_POINT(type, nmax, has_min, type_size)                                           \
    void quanta_quantize_##type##_w(const float *x, const float *qw, uint8_t *out, int64_t nb,                \
                                    int64_t row_blocks) {                                                     \
        legacy_weighted(x, qw, out, nb, row_blocks, nmax, has_min, type_size);                                 \
    }

LEGACY_WEIGHTED_ENTRY_POINT(q4_0, 8, 0, 18)
LEGACY_WEIGHTED_ENTRY_POINT(q5_0, 16, 0, 22)
LEGACY_WEIGHTED_ENTRY_POINT(q4_1, 15, 1, 20)
LEGACY_WEIGHTED_ENTRY_POINT(q5_1, 31, 1, 24)
