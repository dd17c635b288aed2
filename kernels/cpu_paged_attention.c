/* Paged attention for decode on CPU: one query token per sequence, read straight from the
 * paged KV pool (no gather copy), grouped-query aware, float32 accumulation.
 *
 * Layouts (all contiguous, row-major):
 *   q            (num_seqs, num_heads, head_dim)                    float32 or bfloat16
 *   k_cache      (num_kv_heads, num_blocks, block_size, head_dim)   same dtype as q
 *   v_cache      (num_kv_heads, num_blocks, block_size, head_dim)
 *   block_tables (num_seqs, max_blocks) int64; context_lens (num_seqs,) int64
 *   out          (num_seqs, num_heads, head_dim)                    same dtype as q
 * Query head h attends with kv head h / (num_heads / num_kv_heads).
 * Sequences [seq_begin, seq_end) are computed. Work items (sequence, kv head) are spread over
 * the OpenMP threads torch already runs (the same libgomp, so no second pool competes).
 * scratch: omp_get_max_threads() * (num_heads / num_kv_heads) * (max_context + 2 * head_dim)
 * floats.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VECTOR_PATH 512
#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR_PATH 256
#endif

#include "cpu_bf16.h"
#include "cpu_panel_runs.h"

#define DEFINE_DECODE(NAME, T, C, LOAD, LOADC, STORE)                                           \
void NAME(const T *q, const C *k_cache, const C *v_cache, const int64_t *block_tables,          \
          const int64_t *context_lens, T *out, int64_t num_heads, int64_t num_kv_heads,         \
          int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,         \
          float scale, int64_t seq_begin, int64_t seq_end, float *scratch) {                    \
    const int64_t group = num_heads / num_kv_heads;                                             \
    const int64_t per_thread = group * (max_blocks * block_size + 2 * head_dim);                \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                            \
    for (int64_t item = seq_begin * num_kv_heads; item < seq_end * num_kv_heads; item++) {     \
            const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;                   \
            const int64_t context = context_lens[s];                                            \
            const int64_t *table = block_tables + s * max_blocks;                               \
            float *scores = scratch + omp_get_thread_num() * per_thread; /* (group, context) */ \
            float *qf = scores + group * context;        /* (group, head_dim) */                \
            float *acc = qf + group * head_dim;          /* (group, head_dim) */                \
            for (int64_t g = 0; g < group; g++) {                                               \
                const T *qrow = q + (s * num_heads + kvh * group + g) * head_dim;               \
                for (int64_t d = 0; d < head_dim; d++) qf[g * head_dim + d] = LOAD(qrow[d]) * scale; \
            }                                                                                   \
            const C *k_head = k_cache + kvh * num_blocks * block_size * head_dim;               \
            const C *v_head = v_cache + kvh * num_blocks * block_size * head_dim;               \
            for (int64_t pos = 0; pos < context; pos++) {                                       \
                const C *krow = k_head + (table[pos / block_size] * block_size                  \
                                          + pos % block_size) * head_dim;                       \
                for (int64_t g = 0; g < group; g++) {                                           \
                    const float *qg = qf + g * head_dim;                                        \
                    float dot = 0.0f;                                                           \
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * LOADC(krow[d]);       \
                    scores[g * context + pos] = dot;                                            \
                }                                                                               \
            }                                                                                   \
            for (int64_t g = 0; g < group; g++) {                                               \
                float *row = scores + g * context;                                              \
                float max = -INFINITY, sum = 0.0f;                                              \
                for (int64_t pos = 0; pos < context; pos++) max = row[pos] > max ? row[pos] : max; \
                for (int64_t pos = 0; pos < context; pos++) {                                   \
                    row[pos] = expf(row[pos] - max);                                            \
                    sum += row[pos];                                                            \
                }                                                                               \
                const float inv = 1.0f / sum;                                                   \
                for (int64_t pos = 0; pos < context; pos++) row[pos] *= inv;                    \
            }                                                                                   \
            memset(acc, 0, sizeof(float) * group * head_dim);                                   \
            for (int64_t pos = 0; pos < context; pos++) {                                       \
                const C *vrow = v_head + (table[pos / block_size] * block_size                  \
                                          + pos % block_size) * head_dim;                       \
                for (int64_t g = 0; g < group; g++) {                                           \
                    const float p = scores[g * context + pos];                                  \
                    float *a = acc + g * head_dim;                                              \
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * LOADC(vrow[d]);          \
                }                                                                               \
            }                                                                                   \
            for (int64_t g = 0; g < group; g++) {                                               \
                T *orow = out + (s * num_heads + kvh * group + g) * head_dim;                   \
                for (int64_t d = 0; d < head_dim; d++) orow[d] = STORE(acc[g * head_dim + d]);  \
            }                                                                                   \
    }                                                                                           \
}

#define IDENTITY(x) (x)
#define WIDEN(x) ((float)(x))
DEFINE_DECODE(paged_decode_attention_f32_generic, float, float, IDENTITY, IDENTITY, IDENTITY)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, uint16_t, bf16_to_float, bf16_to_float,
              float_to_bf16)
/* float32 queries and outputs over a float16 cache (half the bytes a decode step reads) */
DEFINE_DECODE(paged_decode_attention_f16kv_generic, float, _Float16, IDENTITY, WIDEN, IDENTITY)

#ifdef VECTOR_PATH
#include <immintrin.h>

/* Ask for the cached rows of positions [from, from + 16) ahead of their use: a sequence's
 * blocks lie anywhere in the pool, so the hardware prefetcher, which follows addresses, stops
 * at each block's end. The loops ask 32 positions ahead (measured, 32 streams x 200 tokens x
 * 30 layers: float16 15.3 -> 12.6 ms; 16 ahead gave 13.7, 48 no more than 32), into L2 (T1),
 * not L1 (T0): on a Zen 4 (bench/attention_bench.py, 30 layers' pools read cold) 32 sequences
 * x ~195 tokens 13.0 -> 8.2 ms, 8 sequences 0.67-0.72x, 1 level; 64 or 96 ahead then changed
 * nothing. Not measured on other CPUs (the bench's --base shows it on any). Later (same
 * bench, Zen 4): the values' first rows asked for while the keys are read, and each thread's
 * next work item's first keys while it computes the current one (the items shared out as
 * runs, cpu_panel_runs.h, so a thread knows its next): 32 sequences 0.89x, 8 sequences
 * 0.87x, 1 sequence level (1.02x). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, const int64_t *table, int64_t from,
                                 int64_t context, int64_t block_size, const int half) {
    const int64_t row_bytes = 64 * (half ? 2 : 4);
    for (int64_t pos = from; pos < from + 16 && pos < context; pos++) {
        const char *row = (const char *)cache
                          + (table[pos / block_size] * block_size + pos % block_size) * row_bytes;
        for (int64_t line = 0; line < row_bytes; line += 64)
            _mm_prefetch(row + line, _MM_HINT_T1);
    }
}

#endif

#if VECTOR_PATH == 512
#include "cpu_vector_math.h"

/* One (sequence, kv head) work item, float32, head_dim a multiple of 16: scores, softmax and
 * the weighted sum of values in vector registers, one pass over the keys and one over the
 * values. */
static void decode_item_f32(const float *q, const float *k_head, const float *v_head,
                            const int64_t *table, int64_t context, int64_t block_size,
                            int64_t head_dim, int64_t group, float scale, float *scores,
                            float *acc, float *out) {
    for (int64_t pos = 0; pos < context; pos++) {
        const float *krow = k_head + (table[pos / block_size] * block_size + pos % block_size)
                            * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * head_dim;
            __m512 dot = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(krow + d), dot);
            scores[g * context + pos] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * context;
        __m512 maxv = _mm512_set1_ps(-INFINITY);
        int64_t pos = 0;
        for (; pos + 16 <= context; pos += 16) maxv = _mm512_max_ps(maxv, _mm512_loadu_ps(row + pos));
        float max = _mm512_reduce_max_ps(maxv);
        for (; pos < context; pos++) max = row[pos] > max ? row[pos] : max;
        const __m512 mv = _mm512_set1_ps(max);
        __m512 sumv = _mm512_setzero_ps();
        for (pos = 0; pos < context; pos += 16) {
            const __mmask16 live = first_lanes(context - pos);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + pos), mv));
            sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(live, e));
            _mm512_mask_storeu_ps(row + pos, live, e);
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(sumv);
        for (pos = 0; pos < context; pos++) row[pos] *= inv;
    }
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    for (int64_t pos = 0; pos < context; pos++) {
        const float *vrow = v_head + (table[pos / block_size] * block_size + pos % block_size)
                            * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * context + pos]);
            float *a = acc + g * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(vrow + d),
                                                        _mm512_loadu_ps(a + d)));
        }
    }
    for (int64_t i = 0; i < group * head_dim; i++) out[i] = acc[i];
}

/* 16 cached values at element `at` of a float32 (half = 0) or float16 (half = 1) cache. */
static inline __m512 load_cached(const void *cache, int64_t at, const int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const _Float16 *)cache + at)));
    return _mm512_loadu_ps((const float *)cache + at);
}

/* decode_item_f32 for head_dim 64 and up to 4 query heads per kv head (G), over a float32 or
 * float16 cache (half): scores 16 positions at a time with one tree sum, and the weighted
 * values summed in registers. */
static inline __attribute__((always_inline)) void decode_item_d64(
                                   const float *q, const void *k_head, const void *v_head,
                                   const int64_t *table, int64_t context, int64_t block_size,
                                   const int G, const int half, float scale, float *scores,
                                   float *out) {
    const __m512 scale_v = _mm512_set1_ps(scale);
    prefetch_rows(k_head, table, 0, context, block_size, half);
    for (int64_t p0 = 0; p0 < context; p0 += 16) {
        const int64_t n = context - p0 < 16 ? context - p0 : 16;
        if (p0 == 0) {
            prefetch_rows(k_head, table, 16, context, block_size, half);
            /* the values' first rows too: in L2 by the time the keys are done */
            prefetch_rows(v_head, table, 0, context, block_size, half);
            prefetch_rows(v_head, table, 16, context, block_size, half);
        }
        prefetch_rows(k_head, table, p0 + 32, context, block_size, half);
        int64_t krow[16];
        for (int64_t i = 0; i < n; i++) {
            const int64_t pos = p0 + i;
            krow[i] = (table[pos / block_size] * block_size + pos % block_size) * 64;
        }
        /* float16 keys widened once into L1 for all G query heads, not once per head */
        float widened[16 * 64];
        const void *keys = k_head;
        if (half) {
            for (int64_t i = 0; i < n; i++) {
                for (int d = 0; d < 64; d += 16)
                    _mm512_storeu_ps(widened + i * 64 + d, load_cached(k_head, krow[i] + d, 1));
                krow[i] = i * 64;
            }
            keys = widened;
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * 64;
            const __m512 q0 = _mm512_loadu_ps(qg), q1 = _mm512_loadu_ps(qg + 16),
                         q2 = _mm512_loadu_ps(qg + 32), q3 = _mm512_loadu_ps(qg + 48);
            __m512 dots[16];
            for (int64_t i = 0; i < 16; i++) {
                if (i >= n) { dots[i] = _mm512_setzero_ps(); continue; }
                const float *k = (const float *)keys + krow[i];
                __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
                __m512 b = _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16));
                a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
                b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), b);
                dots[i] = _mm512_add_ps(a, b);
            }
            _mm512_mask_storeu_ps(scores + g * context + p0, first_lanes(n),
                                  _mm512_mul_ps(sum16(dots), scale_v));
        }
    }
    for (int g = 0; g < G; g++) {
        float *row = scores + g * context;
        __m512 maxv = _mm512_set1_ps(-INFINITY);
        for (int64_t pos = 0; pos < context; pos += 16)
            maxv = _mm512_max_ps(maxv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                             first_lanes(context - pos), row + pos));
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(maxv));
        __m512 sumv = _mm512_setzero_ps();
        for (int64_t pos = 0; pos < context; pos += 16) {
            const __mmask16 live = first_lanes(context - pos);
            const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(live, row + pos), mv)));
            sumv = _mm512_add_ps(sumv, e);
            _mm512_mask_storeu_ps(row + pos, live, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sumv));
        for (int64_t pos = 0; pos < context; pos += 16) {
            const __mmask16 live = first_lanes(context - pos);
            _mm512_mask_storeu_ps(row + pos, live,
                                  _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + pos), inv));
        }
    }
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < 4; d++) acc[g][d] = _mm512_setzero_ps();
    for (int64_t pos = 0; pos < context; pos++) {
        if (pos % 16 == 0) prefetch_rows(v_head, table, pos + 32, context, block_size, half);
        const int64_t v = (table[pos / block_size] * block_size + pos % block_size) * 64;
        const __m512 v0 = load_cached(v_head, v, half), v1 = load_cached(v_head, v + 16, half),
                     v2 = load_cached(v_head, v + 32, half), v3 = load_cached(v_head, v + 48, half);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * context + pos]);
            acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < 4; d++) _mm512_storeu_ps(out + g * 64 + d * 16, acc[g][d]);
}

#elif VECTOR_PATH == 256
#include "cpu_vector_math.h"

/* 8 cached values at element `at` of a float32 (half = 0) or float16 (half = 1) cache. */
static inline __m256 load_cached(const void *cache, int64_t at, const int half) {
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const _Float16 *)cache + at)));
    return _mm256_loadu_ps((const float *)cache + at);
}

/* The AVX-512 path's decode_item_d64 in 8 lanes (AVX2: 16 vector registers, not 32): scores
 * 8 positions at a time with one tree sum, then the weighted values summed in registers a
 * quarter of head_dim at a time (each quarter's sums for all G heads fit in registers). */
static inline __attribute__((always_inline)) void decode_item_d64(
                                   const float *q, const void *k_head, const void *v_head,
                                   const int64_t *table, int64_t context, int64_t block_size,
                                   const int G, const int half, float scale, float *scores,
                                   float *out) {
    if (context <= 0) {  /* nothing to attend to (and no last vector to mask) */
        for (int i = 0; i < G * 64; i++) out[i] = 0.0f;
        return;
    }
    const __m256 scale_v = _mm256_set1_ps(scale);
    /* each head's scores in a row of whole vectors (the scratch has room: see decode_items) */
    const int64_t stride = (context + 7) & ~(int64_t)7;
    prefetch_rows(k_head, table, 0, context, block_size, half);
    for (int64_t p0 = 0; p0 < context; p0 += 8) {
        const int64_t n = context - p0 < 8 ? context - p0 : 8;
        if (p0 == 0) {
            prefetch_rows(k_head, table, 16, context, block_size, half);
            prefetch_rows(v_head, table, 0, context, block_size, half);
            prefetch_rows(v_head, table, 16, context, block_size, half);
        }
        if (p0 % 16 == 0) prefetch_rows(k_head, table, p0 + 32, context, block_size, half);
        /* Each key row is widened into 8 registers once and dotted with all G query heads
         * (their loads folded into the multiplies); a head's 8 partial sums per row wait in
         * L1 until 8 rows are done, then one tree sum gives 8 scores. */
        __m256 partial[4][8];
        for (int64_t i = 0; i < n; i++) {
            const int64_t pos = p0 + i;
            const int64_t at = (table[pos / block_size] * block_size + pos % block_size) * 64;
            __m256 k[8];
            for (int j = 0; j < 8; j++) k[j] = load_cached(k_head, at + 8 * j, half);
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * 64;
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]);
                __m256 b = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), k[1]);
                for (int j = 2; j < 8; j += 2) {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), k[j], a);
                    b = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j + 8), k[j + 1], b);
                }
                partial[g][i] = _mm256_add_ps(a, b);
            }
        }
        for (int g = 0; g < G; g++) {
            for (int64_t i = n; i < 8; i++) partial[g][i] = _mm256_setzero_ps();
            _mm256_storeu_ps(scores + g * stride + p0, _mm256_mul_ps(sum8x8(partial[g]), scale_v));
        }
    }
    /* Softmax over whole vectors: masked loads and stores are slow on some AVX2 CPUs
     * (AMD), so only the last vector's dead lanes are set, to -inf by a blend, and each
     * head's 1 / sum is applied to its weighted values rather than to every score. */
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    const int64_t last = stride - 8;
    const __m256 live = _mm256_castsi256_ps(first_lanes8(context - last));
    float inv[4];
    for (int g = 0; g < G; g++) {
        float *row = scores + g * stride;
        _mm256_storeu_ps(row + last, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(row + last), live));
        __m256 maxv = minus_inf;
        for (int64_t pos = 0; pos < stride; pos += 8)
            maxv = _mm256_max_ps(maxv, _mm256_loadu_ps(row + pos));
        const __m256 mv = _mm256_set1_ps(max8(maxv));
        __m256 sumv = _mm256_setzero_ps();
        for (int64_t pos = 0; pos < last; pos += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + pos), mv));
            sumv = _mm256_add_ps(sumv, e);
            _mm256_storeu_ps(row + pos, e);
        }
        /* the dead lanes' -inf gives exp256's floor, 2^-149 at most: nothing to the sum */
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + last), mv));
        _mm256_storeu_ps(row + last, e);
        inv[g] = 1.0f / sum8(_mm256_add_ps(sumv, e));
    }
    /* The weighted values a quarter of head_dim at a time, all G heads' sums for that quarter
     * in registers (AVX2 has 16). */
    for (int d0 = 0; d0 < 64; d0 += 16) {
        __m256 acc[4][2];
        for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        for (int64_t pos = 0; pos < context; pos++) {
            if (d0 == 0 && pos % 16 == 0)
                prefetch_rows(v_head, table, pos + 32, context, block_size, half);
            const int64_t v = (table[pos / block_size] * block_size + pos % block_size) * 64 + d0;
            const __m256 v0 = load_cached(v_head, v, half), v1 = load_cached(v_head, v + 8, half);
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(scores[g * stride + pos]);
                acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 scale_g = _mm256_set1_ps(inv[g]);
            _mm256_storeu_ps(out + g * 64 + d0, _mm256_mul_ps(acc[g][0], scale_g));
            _mm256_storeu_ps(out + g * 64 + d0 + 8, _mm256_mul_ps(acc[g][1], scale_g));
        }
    }
}
#endif

#ifdef VECTOR_PATH
/* decode_item_d64 with its group size and cache kind as constants (unrolled loops); 0 when
 * head_dim or group is not one it has. */
static inline int decode_item_d64_any(const float *q, const void *k_head, const void *v_head,
                                      const int64_t *table, int64_t context,
                                      int64_t block_size, int64_t head_dim, int64_t group,
                                      const int half, float scale, float *scores, float *out) {
    if (head_dim != 64 || group < 1 || group > 4) return 0;
    /* The default block size as a constant: each position's block and offset are then a
     * shift and a mask, not two integer divisions (measured: 30 layers x 32 sequences x 192
     * positions: 7.5 -> 5.7 ms cache-resident, 13.0 -> 10.0 ms from memory). */
#define ITEM(BS, G) decode_item_d64(q, k_head, v_head, table, context, BS, G, half, scale, \
                                    scores, out)
    if (block_size == 16) {
        switch (group) {
        case 1: ITEM(16, 1); return 1;
        case 2: ITEM(16, 2); return 1;
        case 3: ITEM(16, 3); return 1;
        default: ITEM(16, 4); return 1;
        }
    }
    switch (group) {
    case 1: ITEM(block_size, 1); return 1;
    case 2: ITEM(block_size, 2); return 1;
    case 3: ITEM(block_size, 3); return 1;
    default: ITEM(block_size, 4); return 1;
    }
#undef ITEM
}

#if VECTOR_PATH == 512
static void decode_item_f32_any(const float *q, const float *k_head, const float *v_head,
                                const int64_t *table, int64_t context, int64_t block_size,
                                int64_t head_dim, int64_t group, float scale, float *scores,
                                float *acc, float *out) {
    if (decode_item_d64_any(q, k_head, v_head, table, context, block_size, head_dim, group, 0,
                            scale, scores, out))
        return;
    decode_item_f32(q, k_head, v_head, table, context, block_size, head_dim, group, scale,
                    scores, acc, out);
}
#else
/* AVX2 has only the head_dim 64 items (the entry points' FAST conditions say so). */
static void decode_item_f32_any(const float *q, const float *k_head, const float *v_head,
                                const int64_t *table, int64_t context, int64_t block_size,
                                int64_t head_dim, int64_t group, float scale, float *scores,
                                float *acc, float *out) {
    (void)acc;
    decode_item_d64_any(q, k_head, v_head, table, context, block_size, head_dim, group, 0,
                        scale, scores, out);
}
#endif

/* One decode_items call's arguments, for its work items. */
typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens;
    float *out, *scratch;
    int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks, first;
    float scale;
    int half;
} attention_items;

/* Work item `item` (after c->first: sequence item / kv heads, kv head item % kv heads), its
 * keys' first rows, and those of the thread's next item, asked for first: a new item's rows
 * lie in other blocks, which the prefetching inside an item reaches only once it runs. */
static void decode_item(void *context_of_items, int64_t item, int64_t next) {
    const attention_items *c = context_of_items;
    const int64_t group = c->num_heads / c->num_kv_heads, element = c->half ? 2 : 4;
    const int64_t per_thread = group * (c->max_blocks * c->block_size + 2 * c->head_dim);
    const int64_t pool_head = c->num_blocks * c->block_size * c->head_dim * element;
    if (next >= 0) {
        next += c->first;
        const int64_t s = next / c->num_kv_heads, kvh = next % c->num_kv_heads;
        const char *k_head = (const char *)c->k_cache + kvh * pool_head;
        prefetch_rows(k_head, c->block_tables + s * c->max_blocks, 0, c->context_lens[s],
                      c->block_size, c->half);
    }
    item += c->first;
    const int64_t s = item / c->num_kv_heads, kvh = item % c->num_kv_heads;
    const int64_t context = c->context_lens[s];
    float *scores = c->scratch + omp_get_thread_num() * per_thread;
    const int64_t head = (s * c->num_heads + kvh * group) * c->head_dim;
    const void *k_head = (const char *)c->k_cache + kvh * pool_head;
    const void *v_head = (const char *)c->v_cache + kvh * pool_head;
    const int64_t *table = c->block_tables + s * c->max_blocks;
    if (c->half)
        decode_item_d64_any(c->q + head, k_head, v_head, table, context, c->block_size,
                            c->head_dim, group, 1, c->scale, scores, c->out + head);
    else
        decode_item_f32_any(c->q + head, k_head, v_head, table, context, c->block_size,
                            c->head_dim, group, c->scale, scores, scores + group * context,
                            c->out + head);
}

/* Every (sequence, kv head) work item over the OpenMP threads, as runs (cpu_panel_runs.h:
 * their lengths differ, and a thread that knows its next item prefetches it), over a float32
 * (half = 0) or float16 (half = 1; head_dim 64, at most 4 query heads a kv head) cache. */
static void decode_items(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *block_tables, const int64_t *context_lens, float *out,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                         float scale, int64_t seq_begin, int64_t seq_end, float *scratch,
                         const int half) {
    const attention_items c = {q, k_cache, v_cache, block_tables, context_lens, out, scratch,
                               num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                               max_blocks, seq_begin * num_kv_heads, scale, half};
    for_each_panel((seq_end - seq_begin) * num_kv_heads, decode_item, (void *)&c);
}
#endif

/* The vector width this build runs (16: AVX-512, 8: AVX2, 0: portable C), for the tests. */
int attention_vector_lanes(void) {
#ifdef VECTOR_PATH
    return VECTOR_PATH / 32;
#else
    return 0;
#endif
}

/* The exported entry points: the vector work items where FAST holds (a condition on
 * head_dim, num_heads and num_kv_heads), the portable loop (GENERIC) otherwise. HALF says
 * the cache C is float16. */
#ifdef VECTOR_PATH
#define TRY_VECTOR_ITEMS(FAST, HALF)                                                            \
    if (FAST) {                                                                                 \
        decode_items(q, k_cache, v_cache, block_tables, context_lens, out, num_heads,           \
                     num_kv_heads, head_dim, num_blocks, block_size, max_blocks, scale,         \
                     seq_begin, seq_end, scratch, HALF);                                        \
        return;                                                                                 \
    }
#else
#define TRY_VECTOR_ITEMS(FAST, HALF)
#endif

#define DEFINE_ENTRY(NAME, C, GENERIC, FAST, HALF)                                              \
void NAME(const float *q, const C *k_cache, const C *v_cache, const int64_t *block_tables,      \
          const int64_t *context_lens, float *out, int64_t num_heads, int64_t num_kv_heads,     \
          int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,         \
          float scale, int64_t seq_begin, int64_t seq_end, float *scratch) {                    \
    TRY_VECTOR_ITEMS(FAST, HALF)                                                                \
    GENERIC(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads,      \
            head_dim, num_blocks, block_size, max_blocks, scale, seq_begin, seq_end, scratch);  \
}

#if VECTOR_PATH == 256
#define F32_FAST (head_dim == 64 && num_heads / num_kv_heads <= 4)
#else
#define F32_FAST (head_dim % 16 == 0)
#endif
DEFINE_ENTRY(paged_decode_attention_f32, float, paged_decode_attention_f32_generic, F32_FAST, 0)
/* paged_decode_attention_f32 over a float16 cache: q and out float32, k_cache and v_cache
 * float16 (written by cpu_small_ops.c's write_kv_f16). */
DEFINE_ENTRY(paged_decode_attention_f16kv, _Float16, paged_decode_attention_f16kv_generic,
             head_dim == 64 && num_heads / num_kv_heads <= 4, 1)
