/* Matrix products from GGUF-quantised weights in 16-bit integer arithmetic (AVX-512 VNNI's
 * vpdpwssd: 32 multiply-adds an instruction, twice float32's 16 at the same issue rate), for
 * products with many input rows, where float32 multiply-adds are the bottleneck.
 *
 * Weights are repacked once, at load, from the float-scale GGUF blocks (cpu_quant_matmul.c's
 * Q4_0F, Q4_1F, Q8_0F). For each 16 output rows and each pair of inputs, a vector of 16 lanes
 * holds that pair's two quants (element lane * 2 + h is input 2p + h of output row lane):
 *   Q8_0: wq (N / 16, K / 2, 32) int8, q, in the order quant_place gives;
 *   Q4_0, Q4_1: wq (N / 16, K / 4, 32) bytes, two pairs' vectors (pairs 2c and 2c + 1) a
 *       32 bytes, in nibbles as quant_place places them, q unsigned (0..15): 4 bits a weight,
 *       as the file's own blocks (a byte a weight doubled the bytes a batch-1 step streams);
 *   d   (N / 16, K / 32, 16) scale_t (float16 or float32, below): each block's scale
 *   m   (N / 16, K / 32, 16) scale_t: each block's offset: Q4_1's m, Q4_0's -8 d
 *       (w = d (q - 8)), no array for Q8_0
 * so the weight each lane multiplies is exactly the file's, w = d * q (+ m). The quants are
 * widened to int16 in registers for a product of few rows (each weight used once), or a panel
 * of output rows at a time into a buffer every input row then reads.
 *
 * Inputs are rounded to int16 per row and per block of 32 (the weights' own blocks): x ~ sx *
 * xq with sx = max|x| / 32767 over the block, so each input keeps 15 bits relative to its
 * block's largest (measured on SmolLM2: logits within 0.009 of float32, where one scale a
 * row gave 0.054 and int8 blocks 1.55). A row's result depends on that row alone, so it is the
 * same whatever else shares the batch. Every weight meets the rounded inputs, its offset m too:
 *   out[i, n] = sum_b sx[i, b] (d[n, b] sum_k q[n, k] xq[i, k] + m[n, b] sum_k xq[i, k])
 * (integer sums exact in int32: |q| <= 127 and 32 terms of |xq| <= 32767 per block). Taking m
 * against the unrounded inputs instead doubled the error (measured: logits 0.023 from
 * float32's), the rounding then meeting only d q, which is not centred on zero.
 * N must be a multiple of 16 and K of 32. Output rows are spread over OpenMP threads.
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_panel_runs.h"

#define QK 32
#define LANES 16
enum { Q4_0F = 102, Q4_1F = 103, Q8_0F = 108 };

typedef struct { float d; uint8_t qs[QK / 2]; } block_q4_0f;
typedef struct { float d, m; uint8_t qs[QK / 2]; } block_q4_1f;
typedef struct { float d; int8_t qs[QK]; } block_q8_0f;

static int64_t block_bytes(int64_t qtype) {
    switch (qtype) {
    case Q4_0F: return sizeof(block_q4_0f);
    case Q4_1F: return sizeof(block_q4_1f);
    case Q8_0F: return sizeof(block_q8_0f);
    default: return 0;
    }
}

/* Quant j (0..31) of a block, its scale and offset (Q4_0's -8 d: its quants unsigned). */
static void block_values(int64_t qtype, const uint8_t *block, int16_t q[QK], float *d,
                         float *m) {
    *m = 0.0f;
    if (qtype == Q8_0F) {
        const block_q8_0f *b = (const block_q8_0f *)block;
        *d = b->d;
        for (int j = 0; j < QK; j++) q[j] = b->qs[j];
        return;
    }
    const uint8_t *qs;
    if (qtype == Q4_1F) {
        const block_q4_1f *b = (const block_q4_1f *)block;
        *d = b->d, *m = b->m, qs = b->qs;
    } else {
        const block_q4_0f *b = (const block_q4_0f *)block;
        *d = b->d, *m = -8.0f * b->d, qs = b->qs;
    }
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (int16_t)(qs[j] & 15);
        q[j + QK / 2] = (int16_t)(qs[j] >> 4);
    }
}

/* Bits a quant takes in wq: 4 for the 4-bit formats, else 8. */
int64_t i16_quant_bits(int64_t qtype) { return qtype == Q8_0F ? 8 : 4; }

/* Where element e (0..31: lane * 2 + input parity) of pair P's vector sits among its group's
 * quants (Q8_0: the byte; 4-bit: the nibble, low nibble first). The vector builds read 16-bit
 * words and shift each vector out of them with an and or a shift, where widening bytes took
 * two shuffles (measured on a Zen 3, a 3072 x 576 Q4_1 product at 1 row, hot: 76 -> 48 us):
 *   AVX-512: word e of 64 bytes holds element e of pairs 2c and 2c + 1 (Q8_0: low and high
 *     byte) or of pairs 4s .. 4s + 3 (4-bit: nibbles 0-3);
 *   AVX2: word e % 16 of 32 bytes holds elements e % 16 and e % 16 + 16 of pair P (Q8_0: low
 *     and high byte) or of pairs 2c and 2c + 1 (4-bit: nibbles 0-1 for 2c, 2-3 for 2c + 1).
 * The portable build keeps byte order: element e is byte e of the pair's 32 (Q8_0), or byte e
 * of the chunk's 32 with pair 2c in the low nibbles and 2c + 1 in the high ones (4-bit). */
#if defined(__AVX512BW__)
#define WORD_ORDER 512
#elif defined(__AVX2__) && defined(__FMA__)
#define WORD_ORDER 256
#endif

static inline int64_t quant_place(int64_t e, int64_t P, int bits) {
#if WORD_ORDER == 512
    return bits == 8 ? P / 2 * 64 + 2 * e + P % 2 : P / 4 * 128 + 4 * e + P % 4;
#elif WORD_ORDER == 256
    return bits == 8 ? P * 32 + 2 * (e % 16) + e / 16
                     : P / 2 * 64 + 4 * (e % 16) + 2 * (P % 2) + e / 16;
#else
    return bits == 8 ? P * 32 + e : P / 2 * 64 + 2 * e + P % 2;
#endif
}

/* The packed scales d and offsets m. The AVX-512 and AVX2 builds keep them as float16: every
 * one is a file's float16 (Q4_0's -8 d too), so nothing is rounded, and a batch-1 step streams
 * a sixth fewer bytes (4-bit quants and two float32 a block of 32 were 0.75 bytes a weight).
 * Measured on a Zen 4 (AVX-512), SmolLM2's products streamed (bench/int16_rows_bench.py):
 * 3-6% faster at 1-32 rows; the portable build keeps float32. */
#if WORD_ORDER == 512
typedef _Float16 scale_t;
#define LOAD_SCALES16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif WORD_ORDER == 256 && defined(__F16C__)
typedef _Float16 scale_t;
#define LOAD_SCALES8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
typedef float scale_t;
#define LOAD_SCALES8(p) _mm256_loadu_ps(p)
#endif

int64_t i16_scale_bytes(void) { return sizeof(scale_t); }

/* 0 when qtype or the shape is unsupported (or a scale is not exact as a scale_t), else 1
 * and the packed arrays written (m for Q4_0 and Q4_1). */
int i16_pack(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, int8_t *wq, scale_t *d,
             scale_t *m) {
    const int64_t bytes = block_bytes(qtype);
    if (!bytes || N % LANES || K % QK) return 0;
    const int64_t nb = K / QK, bits = i16_quant_bits(qtype);
    if (bits == 4) memset(wq, 0, (size_t)(N * K / 2));
    int exact = 1;
    /* a group's rows share bytes (4-bit formats), so a thread packs whole groups */
    #pragma omp parallel for schedule(static) reduction(&& : exact)
    for (int64_t g = 0; g < N / LANES; g++)
        for (int64_t lane = 0; lane < LANES; lane++) {
            const int64_t n = g * LANES + lane;
            for (int64_t b = 0; b < nb; b++) {
                int16_t q[QK];
                float ds, ms;
                block_values(qtype, w + (n * nb + b) * bytes, q, &ds, &ms);
                d[(g * nb + b) * LANES + lane] = (scale_t)ds;
                if (m) m[(g * nb + b) * LANES + lane] = (scale_t)ms;
                exact = exact && (float)(scale_t)ds == ds && (float)(scale_t)ms == ms;
                for (int j = 0; j < QK; j++) {
                    const int64_t k = b * QK + j, e = lane * 2 + k % 2;
                    const int64_t at = quant_place(e, k / 2, (int)bits);
                    if (bits == 8)
                        wq[g * K * LANES + at] = (int8_t)q[j];
                    else
                        ((uint8_t *)wq)[g * K * LANES / 2 + at / 2] |=
                            (uint8_t)(q[j] << (at % 2 ? 4 : 0));
                }
            }
        }
    return exact;
}

/* One block of 32 inputs -> 32 int16 quants, the block's scale, and the sum of the rounded
 * inputs (scale times the quants' sum). */
static inline void quantize_block(const float *v, int16_t *q, float *scale, float *sum);

/* Each row of x (M, K) float32 -> xq (M, K) int16, sx (M, K / 32) scales and, when sums is
 * not NULL, each block's sum of its rounded inputs (for Q4_1's offsets). */
void i16_quantize_rows(const float *x, int64_t M, int64_t K, int16_t *xq, float *sx,
                       float *sums) {
    const int64_t blocks = M * (K / QK);
    #pragma omp parallel for schedule(static) if (blocks > 256)
    for (int64_t i = 0; i < blocks; i++) {
        float sum;
        quantize_block(x + i * QK, xq + i * QK, sx + i, &sum);
        if (sums) sums[i] = sum;
    }
}

#ifdef __AVX512BW__
#include <immintrin.h>

#ifdef __AVX512VNNI__
#define DOT_PAIRS(acc, w, x) _mm512_dpwssd_epi32((acc), (w), (x))
#else /* AVX-512 without VNNI: the same sums in two instructions */
#define DOT_PAIRS(acc, w, x) _mm512_add_epi32((acc), _mm512_madd_epi16((w), (x)))
#endif

static inline void quantize_block(const float *v, int16_t *q, float *scale, float *sum) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *scale = top > 0.0f ? top / 32767.0f : 1.0f;
    const __m512 inverse = _mm512_set1_ps(1.0f / *scale);
    /* round to nearest even, as lrintf in the portable path */
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtsepi32_epi16(qb));
    *sum = *scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

#define MR 4 /* input rows a tile */
#define NR 3 /* 16-row weight groups a tile */

/* The panel tiles (and widen_panel) are scheduled with their register pressure in view: at
 * -O3 alone the 4 x 3 tile's 24 live accumulators were copied between registers around every
 * multiply-add and each weight vector loaded three times a pair. SmolLM2's products streamed
 * in model order on a Zen 4 (bench/int16_rows_bench.py): 32 rows 0.74-0.88x, 64 rows
 * 0.69-0.90x, 1-8 rows level. Only here: the whole file so compiled lost 4-6% at 4-16 rows
 * (the direct tiles), and the AVX2 build's tile 6-9% at 32-64 rows. Scheduling moves
 * instructions, not arithmetic: the same bits. */
#pragma GCC push_options
#pragma GCC optimize("schedule-insns", "sched-pressure")

/* out rows [i0, i0 + mr) x the panel's nr weight groups (wq, d, m and out start at the
 * panel's first): per block, integer sums of pairs in registers, then scaled into float
 * accumulators (all mr * nr * 2 vectors in registers). */
static inline __attribute__((always_inline)) void tile(const int16_t *restrict xq, const float *restrict sx,
                        const float *restrict sums, const int16_t *restrict wq,
                        const scale_t *restrict d, const scale_t *restrict m, int64_t K,
                        int64_t N, int64_t i0, const int mr, const int nr,
                        float *restrict out) {
    const int64_t nb = K / QK, pairs = K / 2;
    __m512 facc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) facc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[MR][NR];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t p = b * QK / 2; p < (b + 1) * QK / 2; p++) {
            __m512i wv[NR];
            for (int j = 0; j < nr; j++)
                wv[j] = _mm512_loadu_si512(wq + (j * pairs + p) * 2 * LANES);
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xq + (i0 + i) * K + 2 * p, sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int j = 0; j < nr; j++) acc[i][j] = DOT_PAIRS(acc[i][j], wv[j], xv);
            }
        }
        for (int j = 0; j < nr; j++) {
            const __m512 dv = LOAD_SCALES16(d + (j * nb + b) * LANES);
            const __m512 mv = m ? LOAD_SCALES16(m + (j * nb + b) * LANES)
                                : _mm512_setzero_ps();
            for (int i = 0; i < mr; i++) {
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[(i0 + i) * nb + b]));
                facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), scale, facc[i][j]);
                if (m)
                    facc[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[(i0 + i) * nb + b]),
                                                 facc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            _mm512_storeu_ps(out + (i0 + i) * N + j * LANES, facc[i][j]);
}

/* The tile for the remaining rows and groups, with constant sizes so it stays in registers. */
static void tile_any(const int16_t *xq, const float *sx, const float *sums, const int16_t *wq,
                     const scale_t *d, const scale_t *m, int64_t K, int64_t N, int64_t i0,
                     int mr, int nr, float *out) {
#define TILE(R, C) tile(xq, sx, sums, wq, d, m, K, N, i0, R, C, out)
    switch (mr * 4 + nr) {
    case 4 * 4 + 3: TILE(4, 3); break;
    case 4 * 4 + 2: TILE(4, 2); break;
    case 4 * 4 + 1: TILE(4, 1); break;
    case 3 * 4 + 3: TILE(3, 3); break;
    case 3 * 4 + 2: TILE(3, 2); break;
    case 3 * 4 + 1: TILE(3, 1); break;
    case 2 * 4 + 3: TILE(2, 3); break;
    case 2 * 4 + 2: TILE(2, 2); break;
    case 2 * 4 + 1: TILE(2, 1); break;
    case 1 * 4 + 3: TILE(1, 3); break;
    case 1 * 4 + 2: TILE(1, 2); break;
    default: TILE(1, 1); break;
    }
#undef TILE
}
#pragma GCC pop_options

/* A product with few input rows uses each weight once: its quants are widened in registers,
 * not into a panel buffer (which costs more than the multiply-adds it feeds when only 1-4
 * rows read it). The integer sums are the same and scaled in the same order as tile(), so
 * each row's result is bit for bit the buffered path's. The pairs of a block alternate
 * between two partial sums, so that one input row still has eight chains of dependent
 * multiply-adds in flight. */
#define DIRECT_ROWS 4
#define DG 4 /* 16-row weight groups a direct tile, for up to two rows (two for more) */

/* The two pairs' weight vectors of chunk c (pairs 2c and 2c + 1) of a group, shifted out of
 * 16-bit words (quant_place): Q8_0's 64 bytes a chunk, a 4-bit format's 64 bytes for two chunks
 * (the odd chunk's nibbles 2 and 3; its load is the even chunk's, from L1). */
static inline void direct_weights(const int8_t *restrict wq, int bits, int64_t c,
                                  __m512i *first, __m512i *second) {
    if (bits == 8) {
        const __m512i v = _mm512_loadu_si512(wq + 4 * c * LANES);
        *first = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
        *second = _mm512_srai_epi16(v, 8);
        return;
    }
    const __m512i v = _mm512_loadu_si512(wq + c / 2 * 4 * LANES);
    const __m512i low4 = _mm512_set1_epi16(15);
    if (c % 2 == 0) {
        *first = _mm512_and_si512(v, low4);
        *second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    } else {
        *first = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4);
        *second = _mm512_srli_epi16(v, 12);
    }
}

static inline __attribute__((always_inline)) void direct_tile(
    const int16_t *restrict xq, const float *restrict sx, const float *restrict sums,
    const int8_t *restrict wq, const scale_t *restrict d, const scale_t *restrict m, int64_t K,
    int64_t N, const int bits, const int mr, const int ng, float *restrict out) {
    const int64_t nb = K / QK, group_bytes = K * LANES * bits / 8;
    __m512 facc[DIRECT_ROWS][DG];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) facc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[DIRECT_ROWS][DG][2];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < ng; j++) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_si512();
        for (int64_t c = b * QK / 4; c < (b + 1) * QK / 4; c++) {
            __m512i w0[DG], w1[DG];
            for (int j = 0; j < ng; j++)
                direct_weights(wq + j * group_bytes, bits, c, &w0[j], &w1[j]);
            for (int i = 0; i < mr; i++) {
                int32_t pairs[2];
                memcpy(pairs, xq + i * K + 4 * c, sizeof pairs);
                const __m512i x0 = _mm512_set1_epi32(pairs[0]), x1 = _mm512_set1_epi32(pairs[1]);
                for (int j = 0; j < ng; j++) {
                    acc[i][j][0] = DOT_PAIRS(acc[i][j][0], w0[j], x0);
                    acc[i][j][1] = DOT_PAIRS(acc[i][j][1], w1[j], x1);
                }
            }
        }
        for (int j = 0; j < ng; j++) {
            const __m512 dv = LOAD_SCALES16(d + (j * nb + b) * LANES);
            const __m512 mv = m ? LOAD_SCALES16(m + (j * nb + b) * LANES)
                                : _mm512_setzero_ps();
            for (int i = 0; i < mr; i++) {
                const __m512i sum = _mm512_add_epi32(acc[i][j][0], acc[i][j][1]);
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[i * nb + b]));
                facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, facc[i][j]);
                if (m)
                    facc[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sums[i * nb + b]),
                                                 facc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) _mm512_storeu_ps(out + i * N + j * LANES, facc[i][j]);
}


int i16_vector_lanes(void) { return 16; }

#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_vector_math.h"

/* AVX2 (no AVX-512): vpmaddwd, 16 multiply-adds an instruction and an add to accumulate;
 * a 16-lane weight group is two vectors of 8. */

static inline int32_t sum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static inline void quantize_block(const float *v, int16_t *q, float *scale, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(v + 8 * j);
    const float top = max8(_mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3]))));
    *scale = top > 0.0f ? top / 32767.0f : 1.0f;
    const __m256 inverse = _mm256_set1_ps(1.0f / *scale);
    __m256i r[4]; /* rounded to nearest even, as lrintf in the portable path */
    for (int j = 0; j < 4; j++) r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], inverse));
    /* packs works within 128-bit halves; the permute puts the 16 values back in order */
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xD8));
    _mm256_storeu_si256((__m256i *)(q + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xD8));
    *sum = *scale * (float)sum8i(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]),
                                                  _mm256_add_epi32(r[2], r[3])));
}

#define MR 4 /* input rows a tile */
#define NR 1 /* 16-row weight groups a tile: 4 x 2 int32 sums, 4 x 2 float ones, 2 weights */

static inline __attribute__((always_inline)) void tile(const int16_t *restrict xq, const float *restrict sx,
                        const float *restrict sums, const int16_t *restrict wq,
                        const scale_t *restrict d, const scale_t *restrict m, int64_t K,
                        int64_t N, int64_t i0, const int mr, float *restrict out) {
    const int64_t nb = K / QK;
    __m256 facc[MR][2];
    for (int i = 0; i < mr; i++) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc[MR][2];
        for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int64_t p = b * QK / 2; p < (b + 1) * QK / 2; p++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wq + p * 2 * LANES));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wq + p * 2 * LANES + 16));
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xq + (i0 + i) * K + 2 * p, sizeof pair);
                const __m256i xv = _mm256_set1_epi32(pair);
                acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(w0, xv));
                acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(w1, xv));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 dv = LOAD_SCALES8(d + b * LANES + 8 * h);
            const __m256 mv = m ? LOAD_SCALES8(m + b * LANES + 8 * h) : _mm256_setzero_ps();
            for (int i = 0; i < mr; i++) {
                const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(i0 + i) * nb + b]));
                facc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), scale, facc[i][h]);
                if (m)
                    facc[i][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sums[(i0 + i) * nb + b]),
                                                 facc[i][h]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (i0 + i) * N + 8 * h, facc[i][h]);
}

static void tile_any(const int16_t *xq, const float *sx, const float *sums, const int16_t *wq,
                     const scale_t *d, const scale_t *m, int64_t K, int64_t N, int64_t i0,
                     int mr, int nr, float *out) {
    (void)nr; /* NR is 1 */
    switch (mr) {
    case 4: tile(xq, sx, sums, wq, d, m, K, N, i0, 4, out); break;
    case 3: tile(xq, sx, sums, wq, d, m, K, N, i0, 3, out); break;
    case 2: tile(xq, sx, sums, wq, d, m, K, N, i0, 2, out); break;
    default: tile(xq, sx, sums, wq, d, m, K, N, i0, 1, out); break;
    }
}

/* Few rows, quants widened in registers (see the AVX-512 path's direct_tile): a 16-lane group
 * is two vectors of 8 lanes, a chunk's two pairs alternate between two partial sums, and two
 * groups a tile keep 16 vector registers enough for one or two rows. */
#define DIRECT_ROWS 4
#define DG 2

/* Pair vectors of chunk c of a group, [pair][half]: pairs 2c and 2c + 1, lanes 0-7, 8-15. */
static inline void direct_weights(const int8_t *restrict wq, int bits, int64_t c,
                                  __m256i w[2][2]) {
    /* WORD_ORDER: each 16-bit word's two bytes or four nibbles, low to high */
    if (bits == 8) {
        for (int pair = 0; pair < 2; pair++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + (4 * c + 2 * pair) * LANES));
            w[pair][0] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
            w[pair][1] = _mm256_srai_epi16(v, 8);
        }
        return;
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + 2 * c * LANES));
    const __m256i low4 = _mm256_set1_epi16(15);
    w[0][0] = _mm256_and_si256(v, low4);
    w[0][1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    w[1][0] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
    w[1][1] = _mm256_srli_epi16(v, 12);
}

static inline __attribute__((always_inline)) void direct_tile(
    const int16_t *restrict xq, const float *restrict sx, const float *restrict sums,
    const int8_t *restrict wq, const scale_t *restrict d, const scale_t *restrict m, int64_t K,
    int64_t N, const int bits, const int mr, const int ng, float *restrict out) {
    const int64_t nb = K / QK, group_bytes = K * LANES * bits / 8;
    __m256 facc[DIRECT_ROWS][DG][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) facc[i][j][0] = facc[i][j][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc[DIRECT_ROWS][DG][2];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < ng; j++) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_si256();
        for (int64_t c = b * QK / 4; c < (b + 1) * QK / 4; c++) {
            __m256i w[DG][2][2];
            for (int j = 0; j < ng; j++) direct_weights(wq + j * group_bytes, bits, c, w[j]);
            for (int i = 0; i < mr; i++) {
                int32_t pairs[2];
                memcpy(pairs, xq + i * K + 4 * c, sizeof pairs);
                const __m256i x0 = _mm256_set1_epi32(pairs[0]), x1 = _mm256_set1_epi32(pairs[1]);
                for (int j = 0; j < ng; j++)
                    for (int h = 0; h < 2; h++)
                        acc[i][j][h] = _mm256_add_epi32(
                            acc[i][j][h], _mm256_add_epi32(_mm256_madd_epi16(w[j][0][h], x0),
                                                           _mm256_madd_epi16(w[j][1][h], x1)));
            }
        }
        for (int j = 0; j < ng; j++)
            for (int h = 0; h < 2; h++) {
                const __m256 dv = LOAD_SCALES8(d + (j * nb + b) * LANES + 8 * h);
                const __m256 mv = m ? LOAD_SCALES8(m + (j * nb + b) * LANES + 8 * h)
                                    : _mm256_setzero_ps();
                for (int i = 0; i < mr; i++) {
                    const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[i * nb + b]));
                    facc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j][h]), scale,
                                                    facc[i][j][h]);
                    if (m)
                        facc[i][j][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sums[i * nb + b]),
                                                        facc[i][j][h]);
                }
            }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(out + i * N + j * LANES + 8 * h, facc[i][j][h]);
}


int i16_vector_lanes(void) { return 8; }

#else /* portable C: the same integer sums and the same float32 steps, one lane at a time */

static inline void quantize_block(const float *v, int16_t *q, float *scale, float *sum) {
    float top = 0.0f;
    for (int j = 0; j < QK; j++) top = fmaxf(top, fabsf(v[j]));
    *scale = top > 0.0f ? top / 32767.0f : 1.0f;
    const float inverse = 1.0f / *scale;
    int32_t total = 0;
    for (int j = 0; j < QK; j++) {
        q[j] = (int16_t)lrintf(v[j] * inverse);
        total += q[j];
    }
    *sum = *scale * (float)total;
}

static void tile_any(const int16_t *xq, const float *sx, const float *sums, const int16_t *wq,
                     const scale_t *d, const scale_t *m, int64_t K, int64_t N, int64_t i0,
                     int mr, int nr, float *out) {
    const int64_t nb = K / QK, pairs = K / 2;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            for (int lane = 0; lane < LANES; lane++) {
                const int64_t g = j;
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t dot = 0;
                    for (int64_t p = b * QK / 2; p < (b + 1) * QK / 2; p++)
                        for (int h = 0; h < 2; h++)
                            dot += (int32_t)wq[((g * pairs + p) * LANES + lane) * 2 + h]
                                   * xq[(i0 + i) * K + 2 * p + h];
                    const int64_t at = (g * nb + b) * LANES + lane;
                    acc = fmaf((float)dot, d[at] * sx[(i0 + i) * nb + b], acc);
                    if (m) acc = fmaf(m[at], sums[(i0 + i) * nb + b], acc);
                }
                out[(i0 + i) * N + g * LANES + lane] = acc;
            }
}

int i16_vector_lanes(void) { return 0; }
#define MR 4
#define NR 3
#endif

#ifdef DIRECT_ROWS
/* Up to 16 rows stay on the direct path, 4 at a time over each tile's weights while they are
 * in L1; the panel path, which widens each panel into a buffer first, is ahead at 32. Measured
 * on SmolLM2's layer products at 5-16 rows: on a Zen 3 (AVX2) 6-20% under the panel path, on
 * a Zen 4 (AVX-512) 0.60-0.86x its time (bench/int16_rows_bench.py). */
#define DIRECT_MAX_ROWS 16
/* Groups [g0, g0 + ng) for all M (<= DIRECT_ROWS) rows by the vector path's direct_tile,
 * with constant sizes so the tile stays in registers: DG groups a tile for up to two rows,
 * DG / 2 for more, single groups for what is left. */
static void direct_any(const int16_t *xq, const float *sx, const float *sums, const int8_t *wq,
                       const scale_t *d, const scale_t *m, int64_t K, int64_t N, int bits, int mr,
                       int64_t g0, int ng, float *out) {
    const int64_t nb = K / QK, group_bytes = K * LANES * bits / 8;
#define DIRECT(B, R, G)                                                                    \
    direct_tile(xq, sx, sums, wq + g * group_bytes, d + g * nb * LANES,                    \
                m ? m + g * nb * LANES : NULL, K, N, B, R, G, out + g * LANES)
#define BY_ROWS(B, G)                                                                      \
    switch (mr) {                                                                          \
    case 4: DIRECT(B, 4, G); break;                                                        \
    case 3: DIRECT(B, 3, G); break;                                                        \
    case 2: DIRECT(B, 2, G); break;                                                        \
    default: DIRECT(B, 1, G); break;                                                       \
    }
    const int wide = mr <= 2 ? DG : DG / 2;
    for (int64_t g = g0; g < g0 + ng;) {
        const int left = (int)(g0 + ng - g);
        if (left >= wide && wide == DG) {
            if (bits == 4) { BY_ROWS(4, DG) } else { BY_ROWS(8, DG) }
            g += DG;
        } else if (left >= DG / 2) {
            if (bits == 4) { BY_ROWS(4, DG / 2) } else { BY_ROWS(8, DG / 2) }
            g += DG / 2;
        } else {
            if (bits == 4) { BY_ROWS(4, 1) } else { BY_ROWS(8, 1) }
            g += 1;
        }
    }
#undef BY_ROWS
#undef DIRECT
}
#endif

#pragma GCC push_options /* the panel path, as for tile() above */
#pragma GCC optimize("schedule-insns", "sched-pressure")
/* The panel's quants (count of them, `bits` wide) widened to int16 in wq's element order, in
 * a buffer of the calling thread's (grown as needed, kept for the next call). */
static const int16_t *widen_panel(const int8_t *wq, int64_t count, int64_t bits) {
    static __thread int16_t *buffer;
    static __thread int64_t capacity;
    if (count > capacity) {
        free(buffer);
        buffer = malloc((size_t)count * sizeof *buffer);
        capacity = buffer ? count : 0;
        if (!buffer) return NULL;
    }
    const int64_t chunk = 2 * LANES; /* quants of one pair's vector */
#if WORD_ORDER == 512
    for (int64_t c = 0; c < count / (2 * chunk); c++) {
        __m512i first, second;
        direct_weights(wq, (int)bits, c, &first, &second);
        _mm512_storeu_si512(buffer + 2 * chunk * c, first);
        _mm512_storeu_si512(buffer + 2 * chunk * c + chunk, second);
    }
#elif WORD_ORDER == 256
    for (int64_t c = 0; c < count / (2 * chunk); c++) {
        __m256i w[2][2];
        direct_weights(wq, (int)bits, c, w);
        for (int v = 0; v < 4; v++)
            _mm256_storeu_si256((__m256i *)(buffer + 2 * chunk * c + 16 * v), w[v / 2][v % 2]);
    }
#else
    if (bits == 8) {
        for (int64_t i = 0; i < count; i++) buffer[i] = wq[i];
        return buffer;
    }
    const uint8_t *packed = (const uint8_t *)wq;
    for (int64_t c = 0; c < count / (2 * chunk); c++)
        for (int64_t e = 0; e < chunk; e++) {
            buffer[2 * chunk * c + e] = packed[chunk * c + e] & 15;
            buffer[2 * chunk * c + chunk + e] = packed[chunk * c + e] >> 4;
        }
#endif
    return buffer;
}

#pragma GCC pop_options

typedef struct {
    const int16_t *xq;
    const float *sx, *sums;
    const int8_t *wq;
    const scale_t *d, *m;
    int64_t M, N, K, bits;
    float *out;
    _Atomic int failed; /* a thread's panel buffer could not be allocated */
} i16_product;

/* Lines [from, from + count) of the `bytes` at `at`, prefetched into L2. */
static inline void prefetch_part(const void *at, int64_t bytes, int64_t from, int64_t count) {
    for (int64_t line = from; line < from + count && line * 64 < bytes; line++)
        __builtin_prefetch((const char *)at + line * 64, 0, 2);
}

/* Panel p widened, then its tiles over all M rows; between the tiles, a share of panel
 * next's quants and scales is prefetched into L2, so that the next widening finds them there
 * instead of waiting on memory (as bf16dot's panels do, cpu_bf16_matmul.c). The panels are
 * shared out as runs (cpu_panel_runs.h), so a preempted thread still hands its work over.
 * Measured on a Zen 4, SmolLM2's products streamed (bench/int16_rows_bench.py), against one
 * panel at a time on demand: AVX-512 build 32-96 rows 0.94-0.95x, AVX2 build 24-64 rows
 * 0.85-0.91x, the same bits. */
static void i16_panel(void *context, int64_t p, int64_t next) {
    i16_product *c = context;
    const int64_t groups = c->N / LANES, nb = c->K / QK, per_group = c->K / 2 * 2 * LANES;
    const int64_t g0 = p * NR, quant_bytes = per_group * c->bits / 8;
    const int nr = groups - g0 < NR ? (int)(groups - g0) : NR;
    const int16_t *panel = widen_panel(c->wq + g0 * quant_bytes, nr * per_group, c->bits);
    if (!panel) {
        atomic_store(&c->failed, 1);
        return;
    }
    const int64_t n0 = next * NR, next_groups = next < 0 ? 0 : groups - n0 < NR ? groups - n0
                                                                                : NR;
    const int64_t scale_bytes = next_groups * nb * LANES * (int64_t)sizeof(scale_t);
    const int64_t tiles = (c->M + MR - 1) / MR;
    const int64_t share = (next_groups * quant_bytes / 64 + tiles) / tiles;
    for (int64_t t = 0; t < tiles; t++) {
        if (next_groups) {
            prefetch_part(c->wq + n0 * quant_bytes, next_groups * quant_bytes, t * share, share);
            prefetch_part(c->d + n0 * nb * LANES, scale_bytes, t * share, share);
            if (c->m) prefetch_part(c->m + n0 * nb * LANES, scale_bytes, t * share, share);
        }
        const int64_t i0 = t * MR;
        const int mr = c->M - i0 < MR ? (int)(c->M - i0) : MR;
        tile_any(c->xq, c->sx, c->sums, panel, c->d + g0 * nb * LANES,
                 c->m ? c->m + g0 * nb * LANES : NULL, c->K, c->N, i0, mr, nr,
                 c->out + g0 * LANES);
    }
}

/* out (M, N) = x @ w^T from i16_quantize_rows' xq, sx, sums and i16_pack's wq, d, m (m and
 * sums NULL for Q8_0), bits = i16_quant_bits(the format). Returns 0 if a thread's buffer could
 * not be allocated. */
int i16_matmul(const int16_t *xq, const float *sx, const float *sums, int64_t M,
               const int8_t *wq, const scale_t *d, const scale_t *m, int64_t N, int64_t K,
               int64_t bits, float *out) {
    const int64_t groups = N / LANES;
#ifdef DIRECT_ROWS
    if (M <= DIRECT_MAX_ROWS) {
        const int64_t nb = K / QK;
        const int64_t tiles = (groups + DG - 1) / DG;
        /* guided: each thread reads long runs of consecutive tiles (consecutive memory), which
         * the prefetchers follow, and the runs shrink toward the end, so a preempted thread
         * still hands work over (measured on a Zen 3, AVX2, SmolLM2's layer products streamed
         * at 1 row: 4.57 ms with one tile at a time, 3.96 guided, 4.01 static) */
        #pragma omp parallel for schedule(guided)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t g0 = t * DG;
            const int ng = groups - g0 < DG ? (int)(groups - g0) : DG;
            for (int64_t i0 = 0; i0 < M; i0 += DIRECT_ROWS)
                direct_any(xq + i0 * K, sx + i0 * nb, sums ? sums + i0 * nb : NULL, wq, d, m,
                           K, N, (int)bits, (int)(M - i0 < DIRECT_ROWS ? M - i0 : DIRECT_ROWS),
                           g0, ng, out + i0 * N);
        }
        return 1;
    }
#endif
    i16_product c = {xq, sx, sums, wq, d, m, M, N, K, bits, out, 0};
    for_each_panel((groups + NR - 1) / NR, i16_panel, &c);
    return !atomic_load(&c.failed);
}
