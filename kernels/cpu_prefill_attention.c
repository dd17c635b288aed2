/* Prefill attention on CPU straight from the paged KV pool: every prefill chunk of a step in one
 * call, each a chunk of query_len tokens at the end of a sequence of context_len tokens (its own
 * keys and values already written to the pool), causal, grouped-query aware, float32
 * accumulation, flash-style (one pass over the keys with a running softmax, so no (query, key)
 * score matrix is ever stored).
 *
 * Why not torch: on CPU, scaled_dot_product_attention over a cached prefix needs the prefix
 * gathered out of the pool and an explicit mask, and reaches ~100 GFLOP/s (measured on a
 * 2-core Zen 5: a 512-token chunk at 8k context, 100 ms a layer); long prompts then spend
 * four fifths of their prefill in attention.
 *
 * One call takes all of a step's chunks: called once per sequence, the per-call Python and the
 * two OpenMP regions of each call cost as much as the attention of a 128-token prompt (measured
 * on a Zen 4: 0.27 ms a call hot, 0.4-0.5 ms inside a 16-prompt prefill step).
 *
 * Layouts (row-major):
 *   q            (tokens, q_stride): token t's heads at q + t * q_stride, each head_dim
 *                contiguous, heads one after another               float32 or bfloat16
 *   out          (tokens, num_heads, head_dim), contiguous, q's dtype; only the chunks' rows
 *                are written
 *   k_cache      (num_kv_heads, num_blocks, block_size, head_dim)   float32, bfloat16, float16
 *   block_tables (num_seqs, table_stride) int64, a sequence's blocks from its row's start
 *   seqs         (num_seqs, 3) int64: the chunk's first token, query_len, context_len
 * Query i of a chunk sits at position context_len - query_len + i and sees keys 0..that
 * position.
 *
 * Two phases. Pack: each sequence's kv heads' keys, transposed into tiles of KEY_TILE (head_dim
 * rows of KEY_TILE keys, so one key tile's scores for a query row are four 16-lane vectors),
 * and its values, as float32 rows; shared by every query tile of the sequence. Attend: work
 * items are (sequence, kv head, QUERY_TILE positions); an item's rows are its positions times
 * the kv head's query heads, taken ROWS at a time (one head, consecutive positions) against
 * each key tile while the tile is in the L1 cache.
 * scratch: prefill_packed_floats(...) (every sequence's packed keys and values) +
 * omp_get_max_threads() * prefill_thread_floats(group, head_dim).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define KEY_TILE 64
#define QUERY_TILE 16
#define ROWS 4

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#include "cpu_bf16.h"

/* n elements of a row in `dtype` as float32 (a plain loop per dtype, so each vectorises). */
static void widen_row(const void *src, int64_t at, int dtype, int64_t n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src + at;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else if (dtype == DTYPE_F16) {
        const _Float16 *s = (const _Float16 *)src + at;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else {
        memcpy(dst, (const float *)src + at, sizeof(float) * n);
    }
}

int64_t prefill_thread_floats(int64_t group, int64_t head_dim) {
    const int64_t rows = group * QUERY_TILE;
    /* queries, accumulators, running max and sum, one row group's probabilities, a key row */
    return rows * head_dim * 2 + rows * 2 + ROWS * KEY_TILE + head_dim + 64;
}

int prefill_vector_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#else
    return 1;
#endif
}

/* Key tile `tile` of one kv head: kt (head_dim, KEY_TILE) transposed keys and vt (KEY_TILE,
 * head_dim) values, zero past the context. */
static void pack_tile(const void *k_head, const void *v_head, int dtype, const int64_t *table,
                      int64_t block_size, int64_t head_dim, int64_t context, int64_t tile,
                      float *kt, float *vt, float *row) {
    for (int64_t j = 0; j < KEY_TILE; j++) {
        const int64_t pos = tile * KEY_TILE + j;
        if (pos >= context) {
            for (int64_t d = 0; d < head_dim; d++) kt[d * KEY_TILE + j] = 0.0f;
            memset(vt + j * head_dim, 0, sizeof(float) * head_dim);
            continue;
        }
        const int64_t at = (table[pos / block_size] * block_size + pos % block_size) * head_dim;
        widen_row(k_head, at, dtype, head_dim, row);
        for (int64_t d = 0; d < head_dim; d++) kt[d * KEY_TILE + j] = row[d];
        widen_row(v_head, at, dtype, head_dim, vt + j * head_dim);
    }
}

#if defined(__AVX512F__)
#include "cpu_vector_math.h"

/* acc[r] = acc[r] * corr[r] + p[r] . vt over NV 16-lane slices of head_dim from `dim`, for
 * the first `keys` keys of the tile (the rest have probability zero). */
static inline __attribute__((always_inline)) void weigh_values(
        const float *p, const float *vt, int64_t head_dim, int64_t dim, int64_t keys,
        const float corr[ROWS], float *acc, const int NV) {
    __m512 a[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * head_dim + dim + 16 * c),
                                    _mm512_set1_ps(corr[r]));
    for (int64_t j = 0; j < keys; j++) {
        __m512 v[4];
        for (int c = 0; c < NV; c++) v[c] = _mm512_loadu_ps(vt + j * head_dim + dim + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            const __m512 b = _mm512_set1_ps(p[r * KEY_TILE + j]);
            for (int c = 0; c < NV; c++) a[r][c] = _mm512_fmadd_ps(b, v[c], a[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(acc + r * head_dim + dim + 16 * c, a[r][c]);
}

/* ROWS query rows (positions pos[r]) against the first NC 16-key groups of one key tile starting
 * at key0 (the groups past the last row's position are all masked: on the diagonal they are
 * skipped, not computed and thrown away). */
static inline __attribute__((always_inline)) void attend_groups(
        const float *qf, const float *kt, const float *vt, int64_t head_dim, int64_t key0,
        const int64_t pos[ROWS], float *m, float *l, float *acc, float *p, const int NC) {
    __m512 s[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NC; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        const float *krow = kt + d * KEY_TILE;
        __m512 k[4];
        for (int c = 0; c < NC; c++) k[c] = _mm512_loadu_ps(krow + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            const __m512 b = _mm512_set1_ps(qf[r * head_dim + d]);
            for (int c = 0; c < NC; c++) s[r][c] = _mm512_fmadd_ps(b, k[c], s[r][c]);
        }
    }
    float corr[ROWS];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < ROWS; r++) {
        /* keys past the row's position: -inf scores, and probability exactly zero */
        __mmask16 keep[4] = {0xffff, 0xffff, 0xffff, 0xffff};
        if (key0 + 16 * NC - 1 > pos[r])
            for (int c = 0; c < NC; c++)
                keep[c] = _mm512_cmple_epi32_mask(
                    _mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * c))),
                    _mm512_set1_epi32((int)pos[r]));
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < NC; c++) top = _mm512_mask_max_ps(top, keep[c], top, s[r][c]);
        const float new_m = fmaxf(m[r], _mm512_reduce_max_ps(top));
        corr[r] = expf(m[r] - new_m);
        const __m512 shift = _mm512_set1_ps(new_m);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < NC; c++) {
            const __m512 e = _mm512_maskz_mov_ps(keep[c], exp512(_mm512_sub_ps(s[r][c], shift)));
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(p + r * KEY_TILE + 16 * c, e);
        }
        l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
        m[r] = new_m;
    }
    int64_t keys = pos[ROWS - 1] - key0 + 1;
    keys = keys > KEY_TILE ? KEY_TILE : keys;
    int64_t dim = 0;
    for (; dim + 64 <= head_dim; dim += 64) weigh_values(p, vt, head_dim, dim, keys, corr, acc, 4);
    for (; dim < head_dim; dim += 16) weigh_values(p, vt, head_dim, dim, keys, corr, acc, 1);
}

static void attend_tile(const float *qf, const float *kt, const float *vt, int64_t head_dim,
                        int64_t key0, const int64_t pos[ROWS], float *m, float *l, float *acc,
                        float *p) {
    const int64_t live = pos[ROWS - 1] - key0 + 1; /* keys any of the rows sees, >= 1 */
    const int groups = live >= KEY_TILE ? 4 : (int)((live + 15) / 16);
    switch (groups) {
    case 1: attend_groups(qf, kt, vt, head_dim, key0, pos, m, l, acc, p, 1); break;
    case 2: attend_groups(qf, kt, vt, head_dim, key0, pos, m, l, acc, p, 2); break;
    case 3: attend_groups(qf, kt, vt, head_dim, key0, pos, m, l, acc, p, 3); break;
    default: attend_groups(qf, kt, vt, head_dim, key0, pos, m, l, acc, p, 4); break;
    }
}
#else
/* The same arithmetic in plain C, for CPUs without AVX-512. */
static void attend_tile(const float *qf, const float *kt, const float *vt, int64_t head_dim,
                        int64_t key0, const int64_t pos[ROWS], float *m, float *l, float *acc,
                        float *p) {
    for (int r = 0; r < ROWS; r++) {
        float s[KEY_TILE];
        for (int j = 0; j < KEY_TILE; j++) s[j] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float qd = qf[r * head_dim + d];
            for (int j = 0; j < KEY_TILE; j++) s[j] += qd * kt[d * KEY_TILE + j];
        }
        float top = -INFINITY;
        for (int j = 0; j < KEY_TILE; j++)
            if (key0 + j <= pos[r] && s[j] > top) top = s[j];
        const float new_m = fmaxf(m[r], top), corr = expf(m[r] - new_m);
        float sum = 0.0f;
        for (int j = 0; j < KEY_TILE; j++) {
            p[r * KEY_TILE + j] = key0 + j <= pos[r] ? expf(s[j] - new_m) : 0.0f;
            sum += p[r * KEY_TILE + j];
        }
        l[r] = l[r] * corr + sum;
        m[r] = new_m;
        float *a = acc + r * head_dim;
        for (int64_t d = 0; d < head_dim; d++) a[d] *= corr;
        for (int j = 0; j < KEY_TILE; j++) {
            const float pj = p[r * KEY_TILE + j];
            if (pj != 0.0f)
                for (int64_t d = 0; d < head_dim; d++) a[d] += pj * vt[j * head_dim + d];
        }
    }
}
#endif

/* One work item: QUERY_TILE positions from `first` (a query index) for kv head kvh of one
 * sequence, whose first query row is at q and first output row at out. */
static void attend_item(const void *q, int64_t q_stride, int qdtype, void *out,
                        const float *kt_head, const float *vt_head, int64_t num_heads,
                        int64_t group, int64_t kvh, int64_t head_dim, int64_t query_len,
                        int64_t context, int64_t first, float scale, float *thread_scratch) {
    const int64_t n = query_len - first < QUERY_TILE ? query_len - first : QUERY_TILE;
    const int64_t rows = group * QUERY_TILE;
    float *qf = thread_scratch, *acc = qf + rows * head_dim, *m = acc + rows * head_dim;
    float *l = m + rows, *p = l + rows, *row = p + ROWS * KEY_TILE;
    /* row g * QUERY_TILE + i: query head kvh * group + g at query index first + i; rows past
     * the chunk repeat its last position and are not written out */
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < QUERY_TILE; i++) {
            const int64_t qi = first + (i < n ? i : n - 1);
            float *dst = qf + (g * QUERY_TILE + i) * head_dim;
            widen_row(q, qi * q_stride + (kvh * group + g) * head_dim, qdtype, head_dim, row);
            for (int64_t d = 0; d < head_dim; d++) dst[d] = row[d] * scale;
        }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t pos0 = context - query_len + first;
    const int64_t last = pos0 + n - 1;
    for (int64_t key0 = 0; key0 <= last; key0 += KEY_TILE) {
        const float *kt = kt_head + key0 * head_dim, *vt = vt_head + key0 * head_dim;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < QUERY_TILE; i += ROWS) {
                int64_t pos[ROWS];
                for (int r = 0; r < ROWS; r++) pos[r] = pos0 + (i + r < n ? i + r : n - 1);
                if (pos[ROWS - 1] < key0) continue; /* the whole tile is in these rows' future */
                const int64_t at = g * QUERY_TILE + i;
                attend_tile(qf + at * head_dim, kt, vt, head_dim, key0, pos, m + at, l + at,
                            acc + at * head_dim, p);
            }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = g * QUERY_TILE + i;
            const float inv = 1.0f / l[r];
            const int64_t at = ((first + i) * num_heads + kvh * group + g) * head_dim;
            if (qdtype == DTYPE_BF16) {
                uint16_t *o = (uint16_t *)out + at;
                for (int64_t d = 0; d < head_dim; d++) o[d] = float_to_bf16(acc[r * head_dim + d] * inv);
            } else {
                float *o = (float *)out + at;
                for (int64_t d = 0; d < head_dim; d++) o[d] = acc[r * head_dim + d] * inv;
            }
        }
}

static int64_t key_tiles(int64_t context) { return (context + KEY_TILE - 1) / KEY_TILE; }

/* Floats of scratch the packed keys and values of these sequences take. */
int64_t prefill_packed_floats(const int64_t *seqs, int64_t num_seqs, int64_t num_kv_heads,
                              int64_t head_dim) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        total += 2 * num_kv_heads * key_tiles(seqs[3 * s + 2]) * KEY_TILE * head_dim;
    return total;
}

/* The sequence whose items [base[s], base[s + 1]) hold item (base ascending, base[0] = 0). */
static int64_t owner(const int64_t *base, int64_t num_seqs, int64_t item) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (base[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

void paged_prefill_attention(const void *q, int64_t q_stride, int qdtype, const void *k_cache,
                             const void *v_cache, int cdtype, const int64_t *block_tables,
                             int64_t table_stride, const int64_t *seqs, int64_t num_seqs,
                             void *out, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t num_blocks, int64_t block_size,
                             float scale, float *scratch) {
    if (num_seqs <= 0) return;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t elem = cdtype == DTYPE_F32 ? 4 : 2, qelem = qdtype == DTYPE_F32 ? 4 : 2;
    const int64_t cache_head = num_blocks * block_size * head_dim * elem; /* bytes */
    const int64_t tile_floats = KEY_TILE * head_dim;
    /* per sequence: where its packed keys start, and its first pack and attend items */
    int64_t packed[num_seqs], pack_base[num_seqs + 1], attend_base[num_seqs + 1];
    pack_base[0] = attend_base[0] = 0;
    int64_t at = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t tiles = key_tiles(seqs[3 * s + 2]);
        packed[s] = at;
        at += 2 * num_kv_heads * tiles * tile_floats;
        pack_base[s + 1] = pack_base[s] + num_kv_heads * tiles;
        attend_base[s + 1] = attend_base[s]
                             + num_kv_heads * ((seqs[3 * s + 1] + QUERY_TILE - 1) / QUERY_TILE);
    }
    float *threads = scratch + at;
    const int64_t per_thread = prefill_thread_floats(group, head_dim);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t item = 0; item < pack_base[num_seqs]; item++) {
        const int64_t s = owner(pack_base, num_seqs, item), local = item - pack_base[s];
        const int64_t tiles = key_tiles(seqs[3 * s + 2]);
        const int64_t kvh = local / tiles, tile = local % tiles;
        float *kt_all = scratch + packed[s], *vt_all = kt_all + num_kv_heads * tiles * tile_floats;
        pack_tile((const char *)k_cache + kvh * cache_head, (const char *)v_cache + kvh * cache_head,
                  cdtype, block_tables + s * table_stride, block_size, head_dim, seqs[3 * s + 2],
                  tile, kt_all + (kvh * tiles + tile) * tile_floats,
                  vt_all + (kvh * tiles + tile) * tile_floats,
                  threads + omp_get_thread_num() * per_thread);
    }
    /* within a sequence the last query tiles see the most keys: start them first so no thread
     * ends with one */
    _Pragma("omp parallel for schedule(dynamic, 1)")
    for (int64_t item = 0; item < attend_base[num_seqs]; item++) {
        const int64_t s = owner(attend_base, num_seqs, item), local = item - attend_base[s];
        const int64_t first = seqs[3 * s], query_len = seqs[3 * s + 1];
        const int64_t context = seqs[3 * s + 2], tiles = key_tiles(context);
        const int64_t query_tiles = (query_len + QUERY_TILE - 1) / QUERY_TILE;
        const int64_t tile = query_tiles - 1 - local / num_kv_heads, kvh = local % num_kv_heads;
        const float *kt_all = scratch + packed[s];
        const float *vt_all = kt_all + num_kv_heads * tiles * tile_floats;
        attend_item((const char *)q + first * q_stride * qelem, q_stride, qdtype,
                    (char *)out + first * num_heads * head_dim * qelem,
                    kt_all + kvh * tiles * tile_floats, vt_all + kvh * tiles * tile_floats,
                    num_heads, group, kvh, head_dim, query_len, context, tile * QUERY_TILE,
                    scale, threads + omp_get_thread_num() * per_thread);
    }
}
