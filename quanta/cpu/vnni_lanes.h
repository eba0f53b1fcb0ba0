/* The 16-lane vectors vnni_matmul.c computes with, one set per instruction set (chosen at compile time with
 * -march=native): vf, 16 float32 lanes; vi, 16 int32 lanes (64 bytes); and quantize_row, an activation row as 8-bit
 * blocks of 32. vi_dot4 adds to each int32 lane the 4 products of its 4 unsigned code bytes with 4 signed activation
 * bytes, exactly (AVX512-VNNI's vpdpbusd; on AVX2 vpmaddubsw then vpmaddwd, whose 16-bit pair sums cannot saturate
 * for codes below 128, so 8-bit codes go through vi_dot4_wide a nibble at a time). Both sets give the same numbers:
 * integer sums are exact and every float32 operation is the same one, lane by lane. */
#ifndef QUANTA_VNNI_LANES_H
#define QUANTA_VNNI_LANES_H
#include <stdint.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VNNI 1
#define VECTOR_BITS 512
typedef __m512 vf;
typedef __m512i vi;
static inline vi vi_load64(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_low_nibbles(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vi vi_high_nibbles(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline vi vi_bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vi vi_dot4(vi acc, vi codes, int32_t x4) {
    return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(x4));
}
static inline vi vi_dot4_wide(vi acc, vi codes, int32_t x4) { return vi_dot4(acc, codes, x4); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_half16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vf_store(float *p, vf a, int live) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << live) - 1), a); }

/* row x as 8-bit blocks of 32: d = max |x| / 127, codes rint(x * 127 / max |x|) (half to even), their sums */
static void quantize_row(const float *x, int64_t blocks, int8_t *q, float *d, int32_t *sum) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        const __m512i c0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i c1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtsepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(c1));
        d[b] = amax / 127.f;
        sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VNNI 1
#define VECTOR_BITS 256
typedef struct { __m256 a, b; } vf;          /* lanes 0-7, 8-15 */
typedef struct { __m256i a, b; } vi;
static inline vi vi_load64(const uint8_t *p) {
    return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
}
static inline vi vi_set1(int32_t a) { return (vi){_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
static inline vi vi_low_nibbles(vi v) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    return (vi){_mm256_and_si256(v.a, low), _mm256_and_si256(v.b, low)};
}
static inline vi vi_high_nibbles(vi v) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    return (vi){_mm256_and_si256(_mm256_srli_epi16(v.a, 4), low), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), low)};
}
static inline vi vi_bytes16(const uint8_t *p) {
    return (vi){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline vi vi_sub(vi x, vi y) { return (vi){_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
static inline vi vi_mullo(vi x, vi y) { return (vi){_mm256_mullo_epi32(x.a, y.a), _mm256_mullo_epi32(x.b, y.b)}; }
#if defined(__AVXVNNI__)
static inline __m256i dot4_half(__m256i acc, __m256i codes, __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, codes, x);
}
#else
static inline __m256i dot4_half(__m256i acc, __m256i codes, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}
#endif
static inline vi vi_dot4(vi acc, vi codes, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
    return (vi){dot4_half(acc.a, codes.a, x), dot4_half(acc.b, codes.b, x)};
}
static inline vi vi_dot4_wide(vi acc, vi codes, int32_t x4) {     /* codes up to 255: 16 * high + low */
    const vi high = vi_dot4(vi_set1(0), vi_high_nibbles(codes), x4);
    const vi low = vi_dot4(acc, vi_low_nibbles(codes), x4);
    return (vi){_mm256_add_epi32(low.a, _mm256_slli_epi32(high.a, 4)),
                _mm256_add_epi32(low.b, _mm256_slli_epi32(high.b, 4))};
}
static inline vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf vf_from_vi(vi x) { return (vf){_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline vf vf_mul(vf x, vf y) { return (vf){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline vf vf_fma(vf x, vf y, vf z) {
    return (vf){_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline vf vf_half16(const uint16_t *p) {
    return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline void vf_store(float *p, vf x, int live) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane), x.a);
    _mm256_maskstore_ps(p + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(live - 8), lane), x.b);
}

/* as the AVX-512 quantize_row, the same numbers: the maximum is exact whatever the order, rint is round-half-even */
static void quantize_row(const float *x, int64_t blocks, int8_t *q, float *d, int32_t *sum) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < blocks; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            m = _mm256_max_ps(m, _mm256_and_ps(v[i], sign));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        __m256i c[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            total = _mm256_add_epi32(total, c[i]);
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = amax / 127.f;
        sum[b] = _mm_cvtsi128_si32(s4);
    }
}
#else
#define HAVE_VNNI 0
#define VECTOR_BITS 0
#endif

#endif
