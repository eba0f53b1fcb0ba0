/* float16 <-> float32 by bit operations, shared by the native sources (quant/ggml/native.c, kernels/cpu):
 * to_f16 rounds to nearest even as GGML_FP32_TO_FP16 and torch's .to(float16) do, overflowing to infinity;
 * from_f16 is exact. */
#ifndef QUANTA_HALF_H
#define QUANTA_HALF_H
#include <stdint.h>
#include <string.h>

static inline uint16_t to_f16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00;                  /* NaN */
    if (x >= 0x477ff000u) return sign | 0x7c00;                 /* >= 65520 rounds to infinity */
    if (x < 0x38800000u) {                                      /* below 2^-14: a subnormal half or zero */
        if (x < 0x33000000u) return sign;
        uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return sign | (uint16_t)r;
    }
    uint32_t r = x - 0x38000000u, res = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (res & 1))) res++;  /* a carry moves into the exponent */
    return sign | (uint16_t)res;
}

static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;            /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    u = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4);
    return f;
}

#endif
