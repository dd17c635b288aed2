/* Matrix products over a bfloat16 copy of a weight with AVX-512 BF16 dot products
 * (vdpbf16ps: 32 multiply-adds an instruction, float32 sums), for the decode steps of a batch
 * (about 4 to 63 rows), inside the one-call decode stack (cpu_decode_stack.c).
 *
 * torch's bfloat16 linears (oneDNN) compute the same products, but a step that calls them
 * leaves the C stack for the per-layer Python path, and oneDNN splits the outputs between the
 * threads up front: a thread the gateway or a client preempts holds up the step. Here the
 * panels are shared out as runs a thread done with its own can take from (cpu_panel_runs.h). Unlike the int16 kernel there is
 * no per-block scaling to do: the weight is a plain bfloat16 matrix.
 *
 * At 32 rows a step's products are compute-bound when their weights are in cache (~93% of
 * vdpbf16ps's rate on a Zen 4), but each panel's first tile waited for its weights from
 * memory. The next panel is now prefetched during the current one, and a decode step's tile
 * is 8 rows by 3 weight groups (was 4 by 4 at every size). SmolLM2's decoder products streamed
 * in model order on a Zen 4 (bench/bf16dot_rows_bench.py): 8-16 rows 0.70-0.84x, 32 rows
 * 0.88-0.92x, 64 rows 0.94-0.96x, 512 rows 0.95x, 2,048 level; the same bits. A prefill's
 * panels are split into row blocks as well (WIDE_BLOCK): 512-2,048 rows 0.94-0.96x.
 *
 * Layouts:
 *   wp  (N / 16, K / 2, 16) uint32: for each 16 output rows and each pair of inputs (2p,
 *       2p + 1), one vector of 16 lanes, lane j holding row j's two weights as bfloat16 (2p in
 *       the low half); bf16_pack_weight builds it from a float32 (N, K) matrix
 *   xp  (M, K / 2) uint32: each input row's pairs as bfloat16 (bf16_pack_rows)
 * Both round to nearest even, as torch's float32 -> bfloat16 conversion does.
 * N must be a multiple of 16 and K of 2. Without AVX-512 BF16 the library builds but
 * bf16_matmul_available() is 0 and nothing should call the products.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_panel_runs.h"
#include "cpu_vector_math.h"

#define LANES 16

/* float32 -> bfloat16 bits, round to nearest even (NaN kept a NaN). */
static inline uint32_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

void bf16_pack_weight(const float *w, int64_t N, int64_t K, uint32_t *wp) {
    const int64_t pairs = K / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / LANES; g++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < LANES; j++) {
                const float *row = w + (g * LANES + j) * K;
                wp[(g * pairs + p) * LANES + j] = to_bf16(row[2 * p]) |
                                                  (to_bf16(row[2 * p + 1]) << 16);
            }
}

void bf16_pack_rows(const float *x, int64_t M, int64_t K, uint32_t *xp) {
    /* a prefill's rows are megabytes: both threads, rather than one while the other waits */
    _Pragma("omp parallel for schedule(static) if (M * K >= 1 << 18)")
    for (int64_t i = 0; i < M; i++)
        for (int64_t p = 0; p < K / 2; p++)
            xp[i * (K / 2) + p] = to_bf16(x[i * K + 2 * p]) | (to_bf16(x[i * K + 2 * p + 1]) << 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int bf16_matmul_available(void) { return 1; }

/* A tile is mr input rows by nr 16-row weight groups: mr * nr sums and nr weight vectors in
 * registers, each weight vector used mr times. A decode step's few rows take 8 x 3; from
 * WIDE_FROM rows (a prefill) 4 x 4, whose 64-row panels read the inputs, which no longer
 * fit in L2, a third fewer times (measured, SmolLM2's products at 2,048 rows: 8 x 3 took
 * 1.03x the time of 4 x 4; at 256-512 rows the two are level). */
#define MR 8
#define NR 3
#define MR_WIDE 4
#define NR_WIDE 4
#define WIDE_FROM 512

/* A panel's tiles prefetch the next panel's weights into L2 (prefetcht1; T0 and NTA gained
 * nothing on a Zen 4), spread over the tiles' loops, so the step streams its weights from
 * memory while it multiplies instead of waiting for them at each panel's first tile. */
typedef struct {
    const char *at;
    int64_t lines;
} prefetch_t;

static inline __attribute__((always_inline)) void tile(const uint32_t *restrict xp,
                                                       const uint32_t *restrict wp,
                                                       int64_t pairs, int64_t N, int64_t i0,
                                                       const int mr, const int nr,
                                                       float *restrict out, prefetch_t ahead,
                                                       const int prefetching) {
    const int64_t per_pair = (ahead.lines + pairs - 1) / pairs;
    __m512 acc[MR][NR_WIDE];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (prefetching)
            for (int64_t l = p * per_pair; l < (p + 1) * per_pair && l < ahead.lines; l++)
                _mm_prefetch(ahead.at + l * 64, _MM_HINT_T1);
        __m512bh wv[NR_WIDE];
        for (int j = 0; j < nr; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512(wp + (j * pairs + p) * LANES);
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(i0 + i) * pairs + p]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) _mm512_storeu_ps(out + (i0 + i) * N + j * LANES, acc[i][j]);
}

/* The tile for any mr <= MR and nr <= NR, or mr <= MR_WIDE and nr <= NR_WIDE, with constant
 * sizes so it stays in registers. */
static void tile_any(const uint32_t *xp, const uint32_t *wp, int64_t pairs, int64_t N,
                     int64_t i0, int mr, int nr, float *out, prefetch_t ahead) {
#define TILE(R) \
    switch (nr) { \
    case 4: tile(xp, wp, pairs, N, i0, R <= MR_WIDE ? R : MR_WIDE, 4, out, ahead, 0); break; \
    case 3: tile(xp, wp, pairs, N, i0, R, 3, out, ahead, 1); break; \
    case 2: tile(xp, wp, pairs, N, i0, R, 2, out, ahead, 1); break; \
    default: tile(xp, wp, pairs, N, i0, R, 1, out, ahead, 1); break; \
    }
    switch (mr) {
    case 8: TILE(8); break;
    case 7: TILE(7); break;
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    default: TILE(1); break;
    }
#undef TILE
}

/* Panel p's tiles over rows [i_begin, i_end) (the panel's weights stay in L2 while its rows
 * pass), prefetching panel `next`'s weights (none if next < 0). */
static void panel(const uint32_t *xp, int64_t i_begin, int64_t i_end, int wide,
                  const uint32_t *wp, int64_t N, int64_t pairs, int64_t p, int64_t next,
                  float *out) {
    const int rows = wide ? MR_WIDE : MR, width = wide ? NR_WIDE : NR;
    const int64_t groups = N / LANES, g0 = p * width, M = i_end - i_begin;
    const int nr = groups - g0 < width ? (int)(groups - g0) : width;
    const char *next_at = NULL;
    int64_t lines = 0;
    if (next >= 0) {
        const int64_t n0 = next * width;
        next_at = (const char *)(wp + n0 * pairs * LANES);
        lines = (groups - n0 < width ? groups - n0 : width) * pairs * LANES * 4 / 64;
    }
    const int64_t tiles = (M + rows - 1) / rows, each = (lines + tiles - 1) / tiles;
    for (int64_t t = 0; t * rows < M; t++) {
        const int64_t i0 = i_begin + t * rows, from = t * each < lines ? t * each : lines;
        const int mr = i_end - i0 < rows ? (int)(i_end - i0) : rows;
        const prefetch_t ahead = {next_at ? next_at + from * 64 : NULL,
                                  lines - from < each ? lines - from : each};
        tile_any(xp, wp + g0 * pairs * LANES, pairs, N, i0, mr, nr, out + g0 * LANES, ahead);
    }
}

/* From WIDE_FROM rows a panel's rows are split into blocks of WIDE_BLOCK, each a work item of
 * its own (a panel's blocks consecutive, so a thread's run keeps the panel's weights in L2):
 * whole panels of a 2,048-row prefill took 0.4-2 ms each, and with 9 of them (SmolLM2's
 * 576-wide products) one of the two threads waited a whole panel at every product's end. */
#define WIDE_BLOCK 256

typedef struct {
    const uint32_t *xp, *wp;
    int64_t M, N, pairs, blocks;
    int wide;
    float *out;
} product;

static void do_panel(void *context, int64_t item, int64_t next) {
    const product *c = context;
    if (!c->wide) {
        panel(c->xp, 0, c->M, 0, c->wp, c->N, c->pairs, item, next, c->out);
        return;
    }
    const int64_t p = item / c->blocks, i0 = item % c->blocks * WIDE_BLOCK;
    const int64_t i1 = i0 + WIDE_BLOCK < c->M ? i0 + WIDE_BLOCK : c->M;
    panel(c->xp, i0, i1, 1, c->wp, c->N, c->pairs, p, -1, c->out);
}

/* out (M, N) = xp @ wp^T, the panels (and from WIDE_FROM rows their row blocks) shared out as
 * runs (cpu_panel_runs.h). */
void bf16_matmul(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                 float *out) {
    const int wide = M >= WIDE_FROM, width = wide ? NR_WIDE : NR;
    const int64_t blocks = wide ? (M + WIDE_BLOCK - 1) / WIDE_BLOCK : 1;
    product c = {xp, wp, M, N, K / 2, blocks, wide, out};
    for_each_panel((N / LANES + width - 1) / width * blocks, do_panel, &c);
}
/* The gate/up product with SiLU applied on the way out: wp is the [gate; up] weight (2 * I
 * rows) and out (M, I) = silu(x @ gate^T) * (x @ up^T), each tile MR_WIDE rows by two gate
 * groups and the two up groups of the same outputs, so the (M, 2 * I) product is never
 * written and read back (a 2,048-token prefill's was 25 MB a layer). The same bits as
 * bf16_matmul then silu_mul (cpu_small_ops.c): the same sums in the same order, the same
 * silu512. */
static inline __attribute__((always_inline)) void silu_tile(
        const uint32_t *restrict xp, const uint32_t *restrict gate, const uint32_t *restrict up,
        int64_t pairs, int64_t I, int64_t i0, const int mr, const int ng, float *restrict out,
        prefetch_t ahead_gate, prefetch_t ahead_up, const int prefetching) {
    const int64_t per_pair = (ahead_gate.lines + pairs - 1) / pairs;
    __m512 g[MR_WIDE][2], u[MR_WIDE][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++) g[i][j] = u[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        if (prefetching)
            for (int64_t l = p * per_pair; l < (p + 1) * per_pair && l < ahead_gate.lines; l++) {
                _mm_prefetch(ahead_gate.at + l * 64, _MM_HINT_T1);
                _mm_prefetch(ahead_up.at + l * 64, _MM_HINT_T1);
            }
        __m512bh gv[2], uv[2];
        for (int j = 0; j < ng; j++) {
            gv[j] = (__m512bh)_mm512_loadu_si512(gate + (j * pairs + p) * LANES);
            uv[j] = (__m512bh)_mm512_loadu_si512(up + (j * pairs + p) * LANES);
        }
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(i0 + i) * pairs + p]);
            for (int j = 0; j < ng; j++) {
                g[i][j] = _mm512_dpbf16_ps(g[i][j], gv[j], xv);
                u[i][j] = _mm512_dpbf16_ps(u[i][j], uv[j], xv);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ng; j++)
            _mm512_storeu_ps(out + (i0 + i) * I + j * LANES,
                             _mm512_mul_ps(silu512(g[i][j]), u[i][j]));
}

static void silu_tile_any(const uint32_t *xp, const uint32_t *gate, const uint32_t *up,
                          int64_t pairs, int64_t I, int64_t i0, int mr, int ng, float *out,
                          prefetch_t ahead_gate, prefetch_t ahead_up) {
#define SILU_TILE(R) \
    (ahead_gate.lines ? (ng == 2 ? silu_tile(xp, gate, up, pairs, I, i0, R, 2, out, ahead_gate, \
                                             ahead_up, 1) \
                                 : silu_tile(xp, gate, up, pairs, I, i0, R, 1, out, ahead_gate, \
                                             ahead_up, 1)) \
                      : (ng == 2 ? silu_tile(xp, gate, up, pairs, I, i0, R, 2, out, ahead_gate, \
                                             ahead_up, 0) \
                                 : silu_tile(xp, gate, up, pairs, I, i0, R, 1, out, ahead_gate, \
                                             ahead_up, 0)))
    switch (mr) {
    case 4: SILU_TILE(4); break;
    case 3: SILU_TILE(3); break;
    case 2: SILU_TILE(2); break;
    default: SILU_TILE(1); break;
    }
#undef SILU_TILE
}

typedef struct {
    const uint32_t *xp, *wp;
    int64_t M, I, pairs, blocks;
    float *out;
} silu_product;

/* Item: two gate groups (and their up groups) over a block of WIDE_BLOCK rows, a panel's
 * blocks consecutive. Below SILU_PREFETCH_BELOW rows (a decode step's) its tiles prefetch
 * the next panel's gate and up weights into L2, as bf16_matmul's panels do (measured on a
 * Zen 4, SmolLM2's 30 gate/up products alternated against none: 8 rows 0.73x, 16 0.81x, 32
 * 0.93x; 64-256 rows 1.01-1.08x, where the arithmetic hides the reads anyway). */
#define SILU_PREFETCH_BELOW 64

static void do_silu_panel(void *context, int64_t item, int64_t next) {
    const silu_product *c = context;
    const int64_t groups = c->I / LANES, g0 = item / c->blocks * 2;
    const int64_t i_begin = item % c->blocks * WIDE_BLOCK;
    const int64_t i_end = i_begin + WIDE_BLOCK < c->M ? i_begin + WIDE_BLOCK : c->M;
    const int ng = groups - g0 < 2 ? 1 : 2;
    const uint32_t *gate = c->wp + g0 * c->pairs * LANES;
    const uint32_t *up = c->wp + (groups + g0) * c->pairs * LANES;
    const char *next_gate = NULL, *next_up = NULL;
    int64_t lines = 0;
    if (c->M < SILU_PREFETCH_BELOW && next >= 0) {
        const int64_t n0 = next * 2;
        next_gate = (const char *)(c->wp + n0 * c->pairs * LANES);
        next_up = (const char *)(c->wp + (groups + n0) * c->pairs * LANES);
        lines = (groups - n0 < 2 ? 1 : 2) * c->pairs * LANES * 4 / 64;
    }
    const int64_t tiles = (i_end - i_begin + MR_WIDE - 1) / MR_WIDE;
    const int64_t each = (lines + tiles - 1) / tiles;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t i0 = i_begin + t * MR_WIDE, from = t * each < lines ? t * each : lines;
        const int64_t count = lines - from < each ? lines - from : each;
        const int mr = i_end - i0 < MR_WIDE ? (int)(i_end - i0) : MR_WIDE;
        const prefetch_t ahead_gate = {next_gate ? next_gate + from * 64 : NULL, count};
        const prefetch_t ahead_up = {next_up ? next_up + from * 64 : NULL, count};
        silu_tile_any(c->xp, gate, up, c->pairs, c->I, i0, mr, ng, c->out + g0 * LANES,
                      ahead_gate, ahead_up);
    }
}

/* out (M, N / 2) = silu(xp @ gate^T) * (xp @ up^T), wp the [gate; up] weight of N rows (N / 2
 * a multiple of 16). */
void bf16_matmul_silu(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                      float *out) {
    const int64_t I = N / 2, blocks = (M + WIDE_BLOCK - 1) / WIDE_BLOCK;
    silu_product c = {xp, wp, M, I, K / 2, blocks, out};
    for_each_panel((I / LANES + 1) / 2 * blocks, do_silu_panel, &c);
}
#else
int bf16_matmul_available(void) { return 0; }

void bf16_matmul(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                 float *out) {
    (void)xp, (void)M, (void)wp, (void)N, (void)K, (void)out;
}

void bf16_matmul_silu(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                      float *out) {
    (void)xp, (void)M, (void)wp, (void)N, (void)K, (void)out;
}
#endif
