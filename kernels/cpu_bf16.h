/* bfloat16 <-> float32 for the CPU kernels' scalar paths (bfloat16 is the top half of a
 * float32; rounding to it is to nearest even, NaN kept a NaN). */
#ifndef TOKSTREAM_CPU_BF16_H
#define TOKSTREAM_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}
#endif
