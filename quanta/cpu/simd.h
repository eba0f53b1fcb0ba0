/* The vector operations the CPU's native kernels use, one set per instruction set (chosen at compile time with
 * -march=native): VL float32 lanes, explicit fused multiply-adds (the sources build with -ffp-contract=off, so a
 * product and a sum fuse only where v_fma says), and a horizontal sum in one fixed order. MR is how many activation
 * rows a GEMM pass takes (what the vector registers hold). */
#ifndef QUANTA_SIMD_H
#define QUANTA_SIMD_H
#include <math.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define MR 4
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define MR 2
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float a) { return _mm256_set1_ps(a); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define VL 4
#define MR 2
typedef float32x4_t vf;
static inline vf v_zero(void) { return vdupq_n_f32(0.f); }
static inline vf v_set1(float a) { return vdupq_n_f32(a); }
static inline vf v_load(const float *p) { return vld1q_f32(p); }
static inline void v_store(float *p, vf a) { vst1q_f32(p, a); }
static inline vf v_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf v_mul(vf a, vf b) { return vmulq_f32(a, b); }
#else
#define VL 1
#define MR 1
typedef float vf;
static inline vf v_zero(void) { return 0.f; }
static inline vf v_set1(float a) { return a; }
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf a) { *p = a; }
static inline vf v_fma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static inline vf v_mul(vf a, vf b) { return a * b; }
#endif

/* the lanes of an accumulator added in a fixed tree (halves, then halves of those) */
static inline float v_sum(vf a) {
#if defined(__AVX512F__)
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), high);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#else
    float t[VL];
    v_store(t, a);
    for (int s = VL / 2; s > 0; s /= 2)
        for (int i = 0; i < s; i++) t[i] += t[i + s];
    return t[0];
#endif
}

#endif
