/* Vector math shared by the CPU kernels (AVX-512 only; callers keep a scalar path). */
#ifndef TOKSTREAM_CPU_VECTOR_MATH_H
#define TOKSTREAM_CPU_VECTOR_MATH_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x in float32: x = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor polynomial in r
 * (relative error below 1e-8 before rounding), scaled by 2^n. Saturates to 0 below -103 and
 * to +inf above 88.8, as expf does. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.8f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result is the sum of v[i]'s 16 lanes: a transpose-and-add tree, ~3 vector
 * ops per sum where a horizontal reduction of each vector takes ~8. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 u[8], s[4];
    for (int j = 0; j < 8; j++)
        u[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        s[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88),
                                   _mm512_shuffle_f32x4(s[0], s[1], 0xDD));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x88),
                                   _mm512_shuffle_f32x4(s[2], s[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}

/* A mask of the first `count` lanes (all 16 when count >= 16). */
static inline __mmask16 first_lanes(long count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}
#endif
#endif
