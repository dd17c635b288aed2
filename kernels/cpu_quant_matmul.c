/* Matrix products straight from GGUF-quantised weights on CPU: each weight row is dequantised
 * into a small float32 buffer (L1-resident) and used at once for every input row, so no float
 * copy of the weights is kept and each quantised byte is read from memory once per call.
 *
 * Layouts (all contiguous, row-major):
 *   w    (N, K / 32) GGUF blocks of qtype, exactly as stored in the file (row n = output n)
 *   x    (M, K) float32
 *   out  (M, N) float32
 * Block formats (ggml): Q4_0 {f16 d; u8 qs[16]}       w = d * (q - 8)
 *                       Q4_1 {f16 d, m; u8 qs[16]}    w = d * q + m
 *                       Q8_0 {f16 d; i8 qs[32]}       w = d * q
 * In the 4-bit formats byte j holds element j (low nibble) and element j + 16 (high nibble).
 *
 * Compiled with -ffp-contract=off so a dequantised weight is the same float as ggml's
 * reference dequantisation (a multiply, then an add: two roundings); the dot products use
 * fmaf explicitly and are reassociated into vector lanes (-fassociative-math).
 * Output rows are spread over the OpenMP threads torch already runs (the same libgomp).
 * scratch: quant_scratch_floats(K) floats.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define QK 32
#define ROWS 4 /* weight rows dequantised and applied together */

/* ggml type ids, and the same formats with their scales widened to float32 at load (+100):
 * a float32 scale is broadcast straight from memory, where a float16 one needs a conversion
 * and a shuffle for every block of 32 weights, the decode loop's bottleneck. */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_0F = 102, Q4_1F = 103, Q8_0F = 108 };

typedef struct { _Float16 d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { _Float16 d, m; uint8_t qs[QK / 2]; } block_q4_1;
typedef struct { _Float16 d; int8_t qs[QK]; } block_q8_0;
typedef struct { float d; uint8_t qs[QK / 2]; } block_q4_0f;
typedef struct { float d, m; uint8_t qs[QK / 2]; } block_q4_1f;
typedef struct { float d; int8_t qs[QK]; } block_q8_0f;

int64_t quant_block_bytes(int64_t qtype) {
    switch (qtype) {
    case Q4_0: return sizeof(block_q4_0);
    case Q4_1: return sizeof(block_q4_1);
    case Q8_0: return sizeof(block_q8_0);
    case Q4_0F: return sizeof(block_q4_0f);
    case Q4_1F: return sizeof(block_q4_1f);
    case Q8_0F: return sizeof(block_q8_0f);
    default: return 0;
    }
}

/* The block's scale d, offset m (Q4_1; 0 otherwise) and quants; *kind is 4 or 8 bits. */
static inline const uint8_t *block_parts(int64_t qtype, const uint8_t *block, float *d,
                                         float *m, int *kind) {
    *m = 0.0f;
    *kind = 4;
    switch (qtype) {
    case Q4_0: *d = (float)((const block_q4_0 *)block)->d; return ((const block_q4_0 *)block)->qs;
    case Q4_1:
        *d = (float)((const block_q4_1 *)block)->d;
        *m = (float)((const block_q4_1 *)block)->m;
        return ((const block_q4_1 *)block)->qs;
    case Q4_0F: *d = ((const block_q4_0f *)block)->d; return ((const block_q4_0f *)block)->qs;
    case Q4_1F:
        *d = ((const block_q4_1f *)block)->d;
        *m = ((const block_q4_1f *)block)->m;
        return ((const block_q4_1f *)block)->qs;
    case Q8_0F: *kind = 8; *d = ((const block_q8_0f *)block)->d;
        return (const uint8_t *)((const block_q8_0f *)block)->qs;
    default: *kind = 8; *d = (float)((const block_q8_0 *)block)->d;
        return (const uint8_t *)((const block_q8_0 *)block)->qs;
    }
}

static inline int is_q4_0(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_0F; }

#ifdef __AVX512F__
#include <immintrin.h>
#define VECTOR_LANES 16

/* 32 weights of one block, dequantised as ggml does (multiply, then add), into o[0..31]. */
static inline void dequantize_block(int64_t qtype, const uint8_t *block, float *o) {
    float ds, ms;
    int kind;
    const uint8_t *qs = block_parts(qtype, block, &ds, &ms, &kind);
    const __m512 d = _mm512_set1_ps(ds);
    if (kind == 8) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)qs);
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
        return;
    }
    const __m128i low4 = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, low4));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4));
    if (is_q4_0(qtype)) { /* d * (q - 8) */
        const __m512i eight = _mm512_set1_epi32(8);
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)), d));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)), d));
        return;
    }
    const __m512 m = _mm512_set1_ps(ms);
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), m));
    _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), m));
}

static void dequantize_row(int64_t qtype, const uint8_t *row, int64_t K, float *restrict out) {
    const int64_t bytes = quant_block_bytes(qtype);
    for (int64_t i = 0; i < K / QK; i++) dequantize_block(qtype, row + i * bytes, out + i * QK);
}

/* out[i * ldo + j] = dot(w row j, x row i) for ROWS weight rows (K apart in w) and MT input
 * rows: 4 x MT vector accumulators, each loaded weight reused MT times. */
static inline void tile(const float *restrict w, const float *restrict x, int64_t ldx,
                        int64_t K, const int MT, float *restrict out, int64_t ldo) {
    __m512 acc[4][ROWS];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[ROWS];
        for (int j = 0; j < ROWS; j++) wv[j] = _mm512_loadu_ps(w + j * K + k);
        for (int i = 0; i < MT; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < ROWS; j++) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < ROWS; j++) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* The 32 weights of one block in two vectors, dequantised in registers (one rounding: a
 * fused multiply-add, where dequantize_block rounds twice as ggml does). */
static inline void block_vectors(int64_t qtype, const uint8_t *block, __m512 *lo, __m512 *hi) {
    float ds, ms;
    int kind;
    const uint8_t *qs = block_parts(qtype, block, &ds, &ms, &kind);
    const __m512 d = _mm512_set1_ps(ds);
    if (kind == 8) {
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)qs))), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(qs + 16)))), d);
        return;
    }
    /* Q4_0 as q * d + (-8 d): exactly d * (q - 8), rounded once. */
    const __m512 m = is_q4_0(qtype) ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)) : _mm512_set1_ps(ms);
    /* One widening of the 16 bytes to 16 lanes, then both nibbles by lane-wise mask and shift
     * (the widening is a shuffle, and shuffles have one port; the mask and shift have two). */
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512i low4 = _mm512_set1_epi32(15);
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low4)), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
}

/* Two weight rows against MT (1-4) input rows, dequantised in registers and used at once: no
 * buffer, each quantised byte read once. For decode, where the weights' bytes are the cost. */
static inline void small_pair(int64_t qtype, const uint8_t *row0, const uint8_t *row1,
                              int64_t K, const float *x, const int MT, float *out, int64_t ldo) {
    const int64_t bytes = quant_block_bytes(qtype);
    /* Separate sums for each half block: four independent FMA chains per input row, so the
     * FMA latency is hidden behind the dequantisation. */
    __m512 acc0_lo[4], acc0_hi[4], acc1_lo[4], acc1_hi[4];
    for (int i = 0; i < MT; i++)
        acc0_lo[i] = acc0_hi[i] = acc1_lo[i] = acc1_hi[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++) {
        __m512 a_lo, a_hi, b_lo, b_hi;
        /* the next pair of rows, a few blocks ahead of the hardware prefetcher */
        _mm_prefetch((const char *)(row1 + (K / QK + b) * bytes + 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(row1 + (2 * (K / QK) + b) * bytes + 256), _MM_HINT_T0);
        block_vectors(qtype, row0 + b * bytes, &a_lo, &a_hi);
        block_vectors(qtype, row1 + b * bytes, &b_lo, &b_hi);
        for (int i = 0; i < MT; i++) {
            const __m512 x_lo = _mm512_loadu_ps(x + i * K + b * QK);
            const __m512 x_hi = _mm512_loadu_ps(x + i * K + b * QK + 16);
            acc0_lo[i] = _mm512_fmadd_ps(a_lo, x_lo, acc0_lo[i]);
            acc0_hi[i] = _mm512_fmadd_ps(a_hi, x_hi, acc0_hi[i]);
            acc1_lo[i] = _mm512_fmadd_ps(b_lo, x_lo, acc1_lo[i]);
            acc1_hi[i] = _mm512_fmadd_ps(b_hi, x_hi, acc1_hi[i]);
        }
    }
    for (int i = 0; i < MT; i++) {
        out[i * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc0_lo[i], acc0_hi[i]));
        out[i * ldo + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc1_lo[i], acc1_hi[i]));
    }
}

/* One weight row against MT (1-8) input rows, as small_pair but a row at a time: MT x 2
 * accumulators fit the 32 registers for one row, not for two. Each quantised block is
 * dequantised once for all MT rows (a verification chunk of drafted tokens, a small batch),
 * and each input row's sum is built in the order small_pair builds it, so it is the same
 * float as when the row is multiplied alone. */
static inline void small_one(int64_t qtype, const uint8_t *row, int64_t K, const float *x,
                             const int MT, float *out, int64_t ldo) {
    const int64_t bytes = quant_block_bytes(qtype);
    __m512 acc_lo[8], acc_hi[8];
    for (int i = 0; i < MT; i++) acc_lo[i] = acc_hi[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / QK; b++) {
        __m512 w_lo, w_hi;
        _mm_prefetch((const char *)(row + (K / QK + b) * bytes + 256), _MM_HINT_T0);
        block_vectors(qtype, row + b * bytes, &w_lo, &w_hi);
        for (int i = 0; i < MT; i++) {
            acc_lo[i] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(x + i * K + b * QK), acc_lo[i]);
            acc_hi[i] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(x + i * K + b * QK + 16),
                                        acc_hi[i]);
        }
    }
    for (int i = 0; i < MT; i++) out[i * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[i],
                                                                                    acc_hi[i]));
}

#define SMALL_M 12 /* at most this many input rows: small_pair or small_one, no buffer */

/* Input rows i0.. (1-8 of them) of one weight row, into out + i0 * ldo. */
static inline void small_one_rows(int64_t qtype, const uint8_t *row, int64_t K, const float *x,
                                  int64_t rows, float *out, int64_t ldo) {
    switch (rows) {
    case 1: small_one(qtype, row, K, x, 1, out, ldo); break;
    case 2: small_one(qtype, row, K, x, 2, out, ldo); break;
    case 3: small_one(qtype, row, K, x, 3, out, ldo); break;
    case 4: small_one(qtype, row, K, x, 4, out, ldo); break;
    case 5: small_one(qtype, row, K, x, 5, out, ldo); break;
    case 6: small_one(qtype, row, K, x, 6, out, ldo); break;
    case 7: small_one(qtype, row, K, x, 7, out, ldo); break;
    default: small_one(qtype, row, K, x, 8, out, ldo); break;
    }
}

static int small_matmul(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                        int64_t M, float *out) {
    if (M > SMALL_M) return 0;
    const int64_t row_bytes = K / QK * quant_block_bytes(qtype);
    if (M > 4) {
        /* 5-12 rows: a weight row at a time, eight input rows a pass (9-12 find the row in
         * L1 the second time); quant_matmul's buffered path, which dequantises each row to
         * floats first, took 1.07-1.7x as long at these sizes, and was level by 16 rows
         * (bench/quant_rows_bench.py) */
        #pragma omp parallel for schedule(dynamic, 32)
        for (int64_t n = 0; n < N; n++)
            for (int64_t i0 = 0; i0 < M; i0 += 8)
                small_one_rows(qtype, w + n * row_bytes, K, x + i0 * K,
                               M - i0 < 8 ? M - i0 : 8, out + i0 * N + n, N);
        return 1;
    }
    /* on demand, as i16_matmul's panels: a preempted thread's rows go to the other */
    #pragma omp parallel for schedule(dynamic, 16)
    for (int64_t n = 0; n < N; n += 2) {
        /* an odd last row pairs with itself; only its first output is kept */
        const uint8_t *row1 = w + (n + 1 < N ? n + 1 : n) * row_bytes;
        float part[4 * 2];
        switch (M) {
        case 1: small_pair(qtype, w + n * row_bytes, row1, K, x, 1, part, 2); break;
        case 2: small_pair(qtype, w + n * row_bytes, row1, K, x, 2, part, 2); break;
        case 3: small_pair(qtype, w + n * row_bytes, row1, K, x, 3, part, 2); break;
        default: small_pair(qtype, w + n * row_bytes, row1, K, x, 4, part, 2); break;
        }
        for (int64_t i = 0; i < M; i++) {
            out[i * N + n] = part[i * 2];
            if (n + 1 < N) out[i * N + n + 1] = part[i * 2 + 1];
        }
    }
    return 1;
}

static void apply_rows(const float *buf, const float *x, int64_t M, int64_t K, float *out,
                       int64_t ldo) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile(buf, x + m * K, K, K, 4, out + m * ldo, ldo);
    switch (M - m) {
    case 3: tile(buf, x + m * K, K, K, 3, out + m * ldo, ldo); break;
    case 2: tile(buf, x + m * K, K, K, 2, out + m * ldo, ldo); break;
    case 1: tile(buf, x + m * K, K, K, 1, out + m * ldo, ldo); break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "cpu_vector_math.h"
#define VECTOR_LANES 8

/* The AVX2 forms of the same steps, 8 lanes a vector (CPUs without AVX-512: Zen 3 and older,
 * the client cores). The arithmetic is the AVX-512 path's; only the sums' order differs. */

/* Eight bytes widened to eight int32 lanes. */
static inline __m256i widen8(const uint8_t *bytes, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)bytes);
    return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

/* A block's 32 quants as four vectors of int32 lanes in element order (4-bit formats: bytes
 * 0-7 and 8-15 hold elements 0-15 in their low nibbles and 16-31 in their high ones). */
static inline void block_quants(const uint8_t *qs, int kind, __m256i q[4]) {
    if (kind == 8) {
        for (int j = 0; j < 4; j++) q[j] = widen8(qs + 8 * j, 1);
        return;
    }
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i a = widen8(qs, 0), b = widen8(qs + 8, 0);
    q[0] = _mm256_and_si256(a, low4);
    q[1] = _mm256_and_si256(b, low4);
    q[2] = _mm256_srli_epi32(a, 4);
    q[3] = _mm256_srli_epi32(b, 4);
}

/* 32 weights of one block, dequantised as ggml does (multiply, then add), into o[0..31]. */
static inline void dequantize_block(int64_t qtype, const uint8_t *block, float *o) {
    float ds, ms;
    int kind;
    __m256i q[4];
    const uint8_t *qs = block_parts(qtype, block, &ds, &ms, &kind);
    block_quants(qs, kind, q);
    const __m256 d = _mm256_set1_ps(ds), m = _mm256_set1_ps(ms);
    const __m256i offset = _mm256_set1_epi32(kind == 4 && is_q4_0(qtype) ? 8 : 0);
    for (int j = 0; j < 4; j++) {
        const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], offset)), d);
        _mm256_storeu_ps(o + 8 * j, kind == 4 && !is_q4_0(qtype) ? _mm256_add_ps(w, m) : w);
    }
}

static void dequantize_row(int64_t qtype, const uint8_t *row, int64_t K, float *restrict out) {
    const int64_t bytes = quant_block_bytes(qtype);
    for (int64_t i = 0; i < K / QK; i++) dequantize_block(qtype, row + i * bytes, out + i * QK);
}

/* The 32 weights of one block in four vectors, dequantised in registers (one rounding, as
 * the AVX-512 path's block_vectors). */
static inline void block_vectors(int64_t qtype, const uint8_t *block, __m256 w[4]) {
    float ds, ms;
    int kind;
    __m256i q[4];
    const uint8_t *qs = block_parts(qtype, block, &ds, &ms, &kind);
    block_quants(qs, kind, q);
    const __m256 d = _mm256_set1_ps(ds);
    const __m256 m = kind == 8 ? _mm256_setzero_ps()
                     : is_q4_0(qtype) ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                     : _mm256_set1_ps(ms);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[j]), d, m);
}

/* One weight row against MT (1-4) input rows, dequantised in registers and used at once (a
 * row at a time, not two as with AVX-512: AVX2 has 16 vector registers, not 32). */
static inline void small_row(int64_t qtype, const uint8_t *row, int64_t K, const float *x,
                             const int MT, float *out) {
    const int64_t bytes = quant_block_bytes(qtype), nb = K / QK;
    __m256 acc[4][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* the next row, a few blocks ahead of the hardware prefetcher */
        _mm_prefetch((const char *)(row + (nb + b) * bytes + 256), _MM_HINT_T0);
        __m256 w[4];
        block_vectors(qtype, row + b * bytes, w);
        for (int i = 0; i < MT; i++) {
            const float *xb = x + i * K + b * QK;
            acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[i][1]);
            acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[i][1]);
        }
    }
    for (int i = 0; i < MT; i++) out[i] = sum8(_mm256_add_ps(acc[i][0], acc[i][1]));
}

#define SMALL_M 8 /* at most this many input rows: small_row, no buffer */

static int small_matmul(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                        int64_t M, float *out) {
    if (M > SMALL_M) return 0;
    const int64_t row_bytes = K / QK * quant_block_bytes(qtype);
    #pragma omp parallel for schedule(dynamic, 32)
    for (int64_t n = 0; n < N; n++) {
        float part[SMALL_M];
        /* 5-8 input rows go four at a time over the row, its bytes in L1 the second time */
        for (int64_t i0 = 0; i0 < M; i0 += 4) {
            const float *xi = x + i0 * K;
            switch (M - i0) {
            case 1: small_row(qtype, w + n * row_bytes, K, xi, 1, part + i0); break;
            case 2: small_row(qtype, w + n * row_bytes, K, xi, 2, part + i0); break;
            case 3: small_row(qtype, w + n * row_bytes, K, xi, 3, part + i0); break;
            default: small_row(qtype, w + n * row_bytes, K, xi, 4, part + i0); break;
            }
        }
        for (int64_t i = 0; i < M; i++) out[i * N + n] = part[i];
    }
    return 1;
}

/* out[i * ldo + j] = dot(w row j, x row i) for ROWS weight rows (K apart in w) and MT (1-2)
 * input rows: 2 x ROWS accumulators and the ROWS weight vectors fit AVX2's 16 registers. */
static inline void tile(const float *restrict w, const float *restrict x, int64_t ldx,
                        int64_t K, const int MT, float *restrict out, int64_t ldo) {
    __m256 acc[2][ROWS];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < ROWS; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[ROWS];
        for (int j = 0; j < ROWS; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < MT; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < ROWS; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < ROWS; j++) out[i * ldo + j] = sum8(acc[i][j]);
}

static void apply_rows(const float *buf, const float *x, int64_t M, int64_t K, float *out,
                       int64_t ldo) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) tile(buf, x + m * K, K, K, 2, out + m * ldo, ldo);
    if (m < M) tile(buf, x + m * K, K, K, 1, out + m * ldo, ldo);
}
#else /* portable C: the same arithmetic, left to the compiler's vectoriser */

static int small_matmul(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                        int64_t M, float *out) {
    (void)qtype; (void)w; (void)N; (void)K; (void)x; (void)M; (void)out;
    return 0;
}

static void dequantize_row(int64_t qtype, const uint8_t *row, int64_t K, float *restrict out) {
    const int64_t bytes = quant_block_bytes(qtype);
    for (int64_t i = 0; i < K / QK; i++) {
        float d, m;
        int kind;
        const uint8_t *qs = block_parts(qtype, row + i * bytes, &d, &m, &kind);
        float *o = out + i * QK;
        if (kind == 8) {
            for (int j = 0; j < QK; j++) o[j] = d * (float)((const int8_t *)qs)[j];
        } else if (is_q4_0(qtype)) {
            for (int j = 0; j < QK / 2; j++) {
                o[j] = d * (float)((int)(qs[j] & 15) - 8);
                o[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
            }
        } else {
            for (int j = 0; j < QK / 2; j++) {
                o[j] = d * (float)(qs[j] & 15) + m;
                o[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        }
    }
}

static void apply_rows(const float *buf, const float *x, int64_t M, int64_t K, float *out,
                       int64_t ldo) {
    for (int64_t m = 0; m < M; m++)
        for (int j = 0; j < ROWS; j++) {
            const float *w = buf + j * K, *xm = x + m * K;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(w[k], xm[k], acc);
            out[m * ldo + j] = acc;
        }
}
#endif

#ifndef VECTOR_LANES
#define VECTOR_LANES 0
#endif
/* The vector width this build runs (16: AVX-512, 8: AVX2, 0: portable C), for the tests. */
int quant_vector_lanes(void) { return VECTOR_LANES; }

/* Floats of scratch quant_matmul needs for K inputs: a ROWS x K buffer per thread. */
int64_t quant_scratch_floats(int64_t K) { return (int64_t)omp_get_max_threads() * ROWS * K; }

/* out (M, N) = x (M, K) @ dequantised(w)^T. K must be a multiple of 32. */
void quant_matmul(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, const float *x,
                  int64_t M, float *out, float *scratch) {
    if (M <= 0) return;
    if (small_matmul(qtype, w, N, K, x, M, out)) return;
    const int64_t row_bytes = K / QK * quant_block_bytes(qtype);
    const int64_t groups = (N + ROWS - 1) / ROWS;
    #pragma omp parallel
    {
        float *buf = scratch + (int64_t)omp_get_thread_num() * ROWS * K;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * ROWS;
            const int64_t nr = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t j = 0; j < nr; j++)
                dequantize_row(qtype, w + (n0 + j) * row_bytes, K, buf + j * K);
            if (nr == ROWS) {
                apply_rows(buf, x, M, K, out + n0, N);
                continue;
            }
            /* The last, partial group: zero rows, and only nr outputs kept. */
            for (int64_t k = nr * K; k < ROWS * K; k++) buf[k] = 0.0f;
            for (int64_t m = 0; m < M; m++) {
                float part[ROWS];
                apply_rows(buf, x + m * K, 1, K, part, ROWS);
                for (int64_t j = 0; j < nr; j++) out[m * N + n0 + j] = part[j];
            }
        }
    }
}

/* out (N, K) float32 = dequantised(w): for products with many input rows, where a float
 * matrix product on the whole dequantised weight is faster than quant_matmul. */
void quant_dequantize(int64_t qtype, const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t row_bytes = K / QK * quant_block_bytes(qtype);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) dequantize_row(qtype, w + n * row_bytes, K, out + n * K);
}
