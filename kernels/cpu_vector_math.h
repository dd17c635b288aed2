/* Vector math shared by the CPU kernels (AVX-512, or AVX2 without it; callers keep a scalar
 * path). */
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

/* silu(g) = g / (1 + e^-g): one definition for every kernel that applies it (the float32 and
 * bfloat16 silu_mul, bf16dot's gate/up product), whose results must agree bit for bit. */
static inline __m512 silu512(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 forms (8 lanes) of the same math, for CPUs without AVX-512. */

/* e^x in float32, as exp512: the same reduction and polynomial; 2^n applied as two exact
 * power-of-two factors (AVX2 has no scalef), each a normal float for every n the clamp
 * allows, so results below the normal range round to denormals and 0 as expf's do. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-103.0f)), _mm256_set1_ps(88.8f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* Lane i of the result is the sum of v[i]'s 8 lanes (a transpose-and-add tree). */
static inline __m256 sum8x8(const __m256 v[8]) {
    __m256 u[4], s[2];
    for (int j = 0; j < 4; j++)
        u[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 2; j++)
        s[j] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44),
                             _mm256_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                         _mm256_permute2f128_ps(s[0], s[1], 0x31));
}

/* A mask (all bits of a lane set) of the first `count` lanes (all 8 when count >= 8), for
 * maskload / maskstore. */
static inline __m256i first_lanes8(long count) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count >= 8 ? 8 : (int)count), index);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
#endif
