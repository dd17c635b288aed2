/* The elementwise steps between a decoder layer's matmuls, fused, float32, on CPU: each reads
 * its inputs once and writes once, where torch runs several ops (and allocations) for each.
 * At batch 1 these steps cost as much as the matmuls' Python dispatch: 30 layers x ~10 ops.
 *
 *   add_rms_norm  x (T, H) += delta (optional), then out = x / rms(x) * weight
 *   rotary        q (T, Hq, D), k (T, Hk, D) rotated in place (Hugging Face half-split),
 *                 rows of q and k `row_stride` floats apart (they are views into one qkv row)
 *   silu_mul      out (T, I) = silu(gate_up[:, :I]) * gate_up[:, I:]
 *   silu_mul_bf16 the same from bfloat16 gate_up to bfloat16 out, computed in float32 exactly
 *                 as silu_mul and rounded once (what silu_mul on the widened inputs, then a
 *                 cast to bfloat16, gives: the inputs and output of a prefill's bfloat16
 *                 products, without the two casts and the float32 tensors between)
 *   write_kv      new keys and values scattered into their cache slots
 * Tokens are spread over the OpenMP threads torch runs when there are enough of them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_bf16.h"
#include "cpu_vector_math.h"

#define PARALLEL_TOKENS 8 /* fewer tokens than this run on the calling thread */

/* The vector width this build runs (16: AVX-512, 8: AVX2, 0: portable C), for the tests. */
int small_ops_vector_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 0;
#endif
}

void add_rms_norm(float *x, const float *delta, const float *weight, float eps, int64_t T,
                  int64_t H, float *out) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < T; t++) {
        float *row = x + t * H;
        float *o = out + t * H;
        float sum = 0.0f;
        if (delta) {
            const float *d = delta + t * H;
            for (int64_t i = 0; i < H; i++) row[i] += d[i];
        }
        for (int64_t i = 0; i < H; i++) sum += row[i] * row[i];
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = row[i] * inv * weight[i];
    }
}

static void rotate_heads(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

void rotary(float *q, float *k, int64_t row_stride, const float *cos, const float *sin,
            int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < T; t++) {
        rotate_heads(q + t * row_stride, Hq, D, cos + t * D, sin + t * D);
        rotate_heads(k + t * row_stride, Hk, D, cos + t * D, sin + t * D);
    }
}

void silu_mul(const float *gate_up, int64_t T, int64_t I, float *out) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i < I; i += 16) {
            const __mmask16 live = first_lanes(I - i);
            const __m512 sig = silu512(_mm512_maskz_loadu_ps(live, g + i));
            _mm512_mask_storeu_ps(o + i, live, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(live, u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(
                _mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_VECTORS 1
/* 16 bfloat16 values (their bits) -> float32, exactly. */
static inline __m512 widen_bf16(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* 16 float32 -> bfloat16 bits, to nearest even (cpu_bf16.h's float_to_bf16, NaN kept a NaN). */
static inline __m256i narrow_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(
        _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}
#endif

void silu_mul_bf16(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *out) {
    #pragma omp parallel for schedule(static) if (T >= PARALLEL_TOKENS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        int64_t i = 0;
#ifdef BF16_VECTORS
        for (; i < I; i += 16) {
            const __mmask16 live = first_lanes(I - i);
            const __m512 sig = silu512(widen_bf16(_mm256_maskz_loadu_epi16(live, g + i)));
            const __m512 uv = widen_bf16(_mm256_maskz_loadu_epi16(live, u + i));
            _mm256_mask_storeu_epi16(o + i, live, narrow_bf16(_mm512_mul_ps(sig, uv)));
        }
#else
        /* silu_mul's own arithmetic, 128 values at a time widened into a [gate; up] row */
        float wide[256], prod[128];
        for (; i < I; i += 128) {
            const int64_t n = I - i < 128 ? I - i : 128;
            for (int64_t e = 0; e < n; e++) {
                wide[e] = bf16_to_float(g[i + e]);
                wide[n + e] = bf16_to_float(u[i + e]);
            }
            silu_mul(wide, 1, n, prod);
            for (int64_t e = 0; e < n; e++) o[i + e] = float_to_bf16(prod[e]);
        }
#endif
    }
}

/* k, v (T, Hk, D) rows `row_stride` floats apart (views into one qkv row) copied into the
 * caches (Hk, num_slots, D) at slots[t]: float32 ones (write_kv), or float16 ones with each
 * value rounded to the nearest float16 (write_kv_f16: half the bytes decode then reads). */
#define DEFINE_WRITE_KV(NAME, T)                                                              \
void NAME(const float *k, const float *v, int64_t row_stride, const int64_t *slots,          \
          int64_t T_, int64_t Hk, int64_t D, int64_t num_slots, T *k_cache, T *v_cache) {    \
    for (int64_t t = 0; t < T_; t++)                                                          \
        for (int64_t h = 0; h < Hk; h++) {                                                    \
            const int64_t at = (h * num_slots + slots[t]) * D;                                \
            const float *ks = k + t * row_stride + h * D, *vs = v + t * row_stride + h * D;   \
            for (int64_t d = 0; d < D; d++) {                                                 \
                k_cache[at + d] = (T)ks[d];                                                   \
                v_cache[at + d] = (T)vs[d];                                                   \
            }                                                                                 \
        }                                                                                     \
}
DEFINE_WRITE_KV(write_kv, float)
DEFINE_WRITE_KV(write_kv_f16, _Float16)

/* out[r] = the index of row r's largest value, the first one on ties (a NaN counts as the
 * largest, the first NaN wins), as torch.argmax. Greedy sampling's whole cost: torch's argmax
 * over (32, 49152) took 1.9 ms here where a max over the same values took 0.12. */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    #pragma omp parallel for schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        int64_t i = 0;
        float max = -INFINITY;
        int nan = 0;
#ifdef __AVX512F__
        /* four running maxima: one would wait on the previous max's latency each step */
        __m512 m[4];
        for (int j = 0; j < 4; j++) m[j] = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 64 <= cols; i += 64)
            for (int j = 0; j < 4; j++) {
                const __m512 v = _mm512_loadu_ps(row + i + 16 * j);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                m[j] = _mm512_max_ps(m[j], v);
            }
        nan = unordered != 0;
        max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]),
                                                 _mm512_max_ps(m[2], m[3])));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 m[4], unordered = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) m[j] = _mm256_set1_ps(-INFINITY);
        for (; i + 32 <= cols; i += 32)
            for (int j = 0; j < 4; j++) {
                const __m256 v = _mm256_loadu_ps(row + i + 8 * j);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                m[j] = _mm256_max_ps(m[j], v);
            }
        nan = _mm256_movemask_ps(unordered) != 0;
        max = max8(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
#endif
        for (; i < cols; i++) {
            if (row[i] != row[i]) nan = 1;
            else if (row[i] > max) max = row[i];
        }
        int64_t found = -1;
        i = 0;
#ifdef __AVX512F__
        const __m512 mv = _mm512_set1_ps(max);
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, mv, _CMP_EQ_OQ);
            if (hit) { found = i + __builtin_ctz(hit); break; }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 mv = _mm256_set1_ps(max);
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
            if (hit) { found = i + __builtin_ctz(hit); break; }
        }
#endif
        for (; found < 0 && i < cols; i++)
            if (nan ? row[i] != row[i] : row[i] == max) found = i;
        out[r] = found < 0 ? 0 : found;
    }
}
