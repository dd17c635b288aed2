/* Every decoder layer of a decode-only step in one call, on CPU, over native GGUF weights.
 *
 * At batch 1 a layer's own arithmetic takes ~0.25 ms and the Python around its dozen kernel
 * calls (argument checks, output allocations, views, ctypes) as much again (measured on
 * SmolLM2: 12.3 ms a step, 8.1 of it in the products). This loop makes the same calls, in the
 * same order and with the same arithmetic, with no Python between them: the kernels are the
 * ones of cpu_quant_matmul.c, cpu_int16_matmul.c, cpu_small_ops.c and cpu_paged_attention.c,
 * passed in as function pointers from their own libraries (one compiled copy of each, one
 * libgomp pool). A product takes the bf16dot or int16 kernel at its weight's measured row
 * ranges for them, as the per-layer path's quantized_linear does.
 *
 * Per layer, T tokens, residual x (T, H) float32 updated in place:
 *   h = rms_norm(x += delta) * input_norm        (delta: the previous layer's MLP output)
 *   qkv = h @ Wqkv^T; rotate q, k; write k, v at slots; attn = paged attention(q)
 *   h = rms_norm(x += attn @ Wo^T) * post_norm
 *   delta = silu(gate) * up @ Wdown^T, [gate; up] = h @ Wgate_up^T
 * and after the last layer out = rms_norm(x += delta) * final_norm.
 */
#include <stdint.h>
#include <string.h>

#define MAX_INT16_RANGES 8 /* quant_linear.MAX_INT16_RANGES */

typedef void (*quant_matmul_fn)(int64_t qtype, const uint8_t *w, int64_t N, int64_t K,
                                const float *x, int64_t M, float *out, float *scratch);
typedef void (*i16_quantize_rows_fn)(const float *x, int64_t M, int64_t K, int16_t *xq,
                                     float *sx, float *sums);
typedef void (*bf16_pack_rows_fn)(const float *x, int64_t M, int64_t K, uint32_t *xp);
typedef void (*bf16_matmul_fn)(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N,
                               int64_t K, float *out);
typedef int (*i16_matmul_fn)(const int16_t *xq, const float *sx, const float *sums,
                             int64_t M, const int8_t *wq, const void *d, const void *m,
                             int64_t N, int64_t K, int64_t bits, float *out);
typedef void (*add_rms_norm_fn)(float *x, const float *delta, const float *weight, float eps,
                                int64_t T, int64_t H, float *out);
typedef void (*rotary_fn)(float *q, float *k, int64_t row_stride, const float *cos,
                          const float *sin, int64_t T, int64_t Hq, int64_t Hk, int64_t D);
typedef void (*silu_mul_fn)(const float *gate_up, int64_t T, int64_t I, float *out);
typedef void (*write_kv_fn)(const float *k, const float *v, int64_t row_stride,
                            const int64_t *slots, int64_t T, int64_t Hk, int64_t D,
                            int64_t num_slots, void *k_cache, void *v_cache);
typedef void (*attention_fn)(const float *q, const void *k_cache, const void *v_cache,
                             const int64_t *block_tables, const int64_t *context_lens,
                             float *out, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t num_blocks, int64_t block_size,
                             int64_t max_blocks, float scale, int64_t seq_begin,
                             int64_t seq_end, float *scratch);

typedef struct {
    quant_matmul_fn quant_matmul;
    i16_quantize_rows_fn i16_quantize_rows;
    i16_matmul_fn i16_matmul;
    bf16_pack_rows_fn bf16_pack_rows;
    bf16_matmul_fn bf16_matmul;
    bf16_matmul_fn bf16_matmul_silu; /* the [gate; up] product with SiLU applied */
    add_rms_norm_fn add_rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    write_kv_fn write_kv;
    attention_fn attention;
} Kernels;

typedef struct {
    const uint8_t *data; /* (out, in / 32 * block bytes) GGUF blocks */
    int64_t qtype;
    const int8_t *quants; /* the int16 path's copy (cpu_int16_matmul.c), or NULL */
    const void *scales, *offsets; /* float16 or float32, as that build keeps them */
    int64_t int16_bits; /* bits a quant of the int16 copy takes (cpu_int16_matmul.c) */
    /* products of lo <= rows < hi take the int16 copy, for each (lo, hi) pair; unused pairs
     * are (0, 0) */
    int64_t int16_ranges[2 * MAX_INT16_RANGES];
    const uint32_t *bf16_pairs; /* the bf16dot copy (cpu_bf16_matmul.c), or NULL */
    int64_t bf16_ranges[2 * MAX_INT16_RANGES]; /* as int16_ranges, for the bf16dot copy */
} QWeight;

static int in_ranges(const int64_t *ranges, int64_t T) {
    for (int r = 0; r < MAX_INT16_RANGES; r++)
        if (ranges[2 * r] <= T && T < ranges[2 * r + 1]) return 1;
    return 0;
}

typedef struct {
    const float *input_norm, *post_norm;
    QWeight qkv, o_proj, gate_up, down;
    void *k_cache, *v_cache; /* (kv_heads, num_blocks, block_size, head_dim), float32 or
                              * float16: write_kv and attention are the kernels for it */
} Layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks, block_size;
    float eps, scale;
} Dims;

/* One step's inputs and its working buffers (all float32 unless named). */
typedef struct {
    int64_t tokens, max_blocks;
    const float *cos, *sin;                  /* (T, head_dim) */
    const int64_t *slots;                    /* (T,) */
    const int64_t *block_tables;             /* (T, max_blocks) */
    const int64_t *context_lens;             /* (T,) */
    const float *final_norm;                 /* (hidden,) */
    float *h;                                /* (T, hidden) */
    float *qkv;                              /* (T, (heads + 2 kv_heads) * head_dim) */
    float *q;                                /* (T, heads * head_dim), contiguous queries */
    float *attn;                             /* (T, heads * head_dim) */
    float *delta;                            /* (T, hidden) */
    float *gate_up;                          /* (T, 2 * intermediate) */
    float *act;                              /* (T, intermediate) */
    float *matmul_scratch, *attention_scratch;
    int16_t *int16_rows;                     /* (T, widest input) int16 */
    float *int16_scales, *int16_sums;        /* (T, widest input / 32) */
    uint32_t *bf16_rows;                     /* (T, widest input / 2) bfloat16 pairs */
} Step;

/* out (T, N) = x (T, K) @ W^T by the weight's kernel for T rows. */
static void linear(const Kernels *k, const QWeight *w, int64_t N, int64_t K, const float *x,
                   int64_t T, float *out, const Step *s) {
    if (w->bf16_pairs && in_ranges(w->bf16_ranges, T)) {
        k->bf16_pack_rows(x, T, K, s->bf16_rows);
        k->bf16_matmul(s->bf16_rows, T, w->bf16_pairs, N, K, out);
        return;
    }
    if (w->quants && in_ranges(w->int16_ranges, T)) {
        float *sums = w->offsets ? s->int16_sums : NULL;
        k->i16_quantize_rows(x, T, K, s->int16_rows, s->int16_scales, sums);
        if (k->i16_matmul(s->int16_rows, s->int16_scales, sums, T, w->quants, w->scales,
                          w->offsets, N, K, w->int16_bits, out))
            return;
        /* no memory for its panel buffer: the fused kernel needs none */
    }
    k->quant_matmul(w->qtype, w->data, N, K, x, T, out, s->matmul_scratch);
}

/* out (T, I) = silu(x @ Wgate^T) * (x @ Wup^T) for the [gate; up] weight: 1 where it takes
 * its bf16dot copy at T rows, SiLU applied in the product (as the per-layer path does,
 * model.silu_product: the same bits as the product then silu_mul; measured on a Zen 4, 30
 * products at 32 rows 0.90x the time); 0 where it does not, and nothing is computed. */
static int silu_product(const Kernels *k, const QWeight *w, int64_t I, int64_t K,
                        const float *x, int64_t T, float *out, const Step *s) {
    if (!(w->bf16_pairs && in_ranges(w->bf16_ranges, T) && I % 16 == 0)) return 0;
    k->bf16_pack_rows(x, T, K, s->bf16_rows);
    k->bf16_matmul_silu(s->bf16_rows, T, w->bf16_pairs, 2 * I, K, out);
    return 1;
}

void decode_stack(const Kernels *k, const Layer *layers, int64_t num_layers, const Dims *d,
                  const Step *s, float *x, float *out) {
    const int64_t T = s->tokens, H = d->hidden, D = d->head_dim;
    const int64_t q_width = d->num_heads * D, kv_width = d->num_kv_heads * D;
    const int64_t row = q_width + 2 * kv_width;
    const int64_t num_slots = d->num_blocks * d->block_size;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        k->add_rms_norm(x, l ? s->delta : NULL, L->input_norm, d->eps, T, H, s->h);
        linear(k, &L->qkv, row, H, s->h, T, s->qkv, s);
        float *q = s->qkv, *key = s->qkv + q_width, *value = s->qkv + q_width + kv_width;
        k->rotary(q, key, row, s->cos, s->sin, T, d->num_heads, d->num_kv_heads, D);
        k->write_kv(key, value, row, s->slots, T, d->num_kv_heads, D, num_slots, L->k_cache,
                    L->v_cache);
        for (int64_t t = 0; t < T; t++)
            memcpy(s->q + t * q_width, q + t * row, (size_t)q_width * sizeof(float));
        k->attention(s->q, L->k_cache, L->v_cache, s->block_tables, s->context_lens, s->attn,
                     d->num_heads, d->num_kv_heads, D, d->num_blocks, d->block_size,
                     s->max_blocks, d->scale, 0, T, s->attention_scratch);
        linear(k, &L->o_proj, H, q_width, s->attn, T, s->delta, s);
        k->add_rms_norm(x, s->delta, L->post_norm, d->eps, T, H, s->h);
        if (!silu_product(k, &L->gate_up, d->intermediate, H, s->h, T, s->act, s)) {
            linear(k, &L->gate_up, 2 * d->intermediate, H, s->h, T, s->gate_up, s);
            k->silu_mul(s->gate_up, T, d->intermediate, s->act);
        }
        linear(k, &L->down, H, d->intermediate, s->act, T, s->delta, s);
    }
    k->add_rms_norm(x, num_layers ? s->delta : NULL, s->final_norm, d->eps, T, H, out);
}

/* Each weight's product of the same T input rows (x: T x that weight's inputs), one after
 * another into out (T x its outputs, overwritten by the next), each by the path its ranges
 * give for T: the products as the stack runs them, with no Python between them, for the
 * crossover probe to time (quant_linear.measure_streamed). shapes: (outputs, inputs) pairs. */
void stack_products(const Kernels *k, const QWeight *weights, const int64_t *shapes, int64_t n,
                    const float *x, int64_t T, float *out, const Step *s) {
    for (int64_t i = 0; i < n; i++)
        linear(k, weights + i, shapes[2 * i], shapes[2 * i + 1], x, T, out, s);
}
