/* Matrix products over a bfloat16 copy of a weight with AVX-512 BF16 dot products
 * (vdpbf16ps: 32 multiply-adds an instruction, float32 sums), for the decode steps of a batch
 * (about 4 to 63 rows), inside the one-call decode stack (cpu_decode_stack.c).
 *
 * torch's bfloat16 linears (oneDNN) compute the same products, but a step that calls them
 * leaves the C stack for the per-layer Python path, and oneDNN splits the outputs between the
 * threads up front: a thread the gateway or a client preempts holds up the step. Here output
 * panels are handed out on demand, as the int16 and fused kernels do. Unlike the int16 kernel
 * there is no per-block scaling to do: the weight is a plain bfloat16 matrix.
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
    for (int64_t i = 0; i < M; i++)
        for (int64_t p = 0; p < K / 2; p++)
            xp[i * (K / 2) + p] = to_bf16(x[i * K + 2 * p]) | (to_bf16(x[i * K + 2 * p + 1]) << 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int bf16_matmul_available(void) { return 1; }

#define MR 4 /* input rows a tile */
#define NR 4 /* 16-row weight groups a tile: MR * NR sums, NR weight vectors in registers */

static inline __attribute__((always_inline)) void tile(const uint32_t *restrict xp,
                                                       const uint32_t *restrict wp,
                                                       int64_t pairs, int64_t N, int64_t i0,
                                                       const int mr, const int nr,
                                                       float *restrict out) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[NR];
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

static void tile_any(const uint32_t *xp, const uint32_t *wp, int64_t pairs, int64_t N,
                     int64_t i0, int mr, int nr, float *out) {
#define TILE(R, C) tile(xp, wp, pairs, N, i0, R, C, out)
    switch (mr * 8 + nr) {
    case 4 * 8 + 4: TILE(4, 4); break;
    case 4 * 8 + 3: TILE(4, 3); break;
    case 4 * 8 + 2: TILE(4, 2); break;
    case 4 * 8 + 1: TILE(4, 1); break;
    case 3 * 8 + 4: TILE(3, 4); break;
    case 3 * 8 + 3: TILE(3, 3); break;
    case 3 * 8 + 2: TILE(3, 2); break;
    case 3 * 8 + 1: TILE(3, 1); break;
    case 2 * 8 + 4: TILE(2, 4); break;
    case 2 * 8 + 3: TILE(2, 3); break;
    case 2 * 8 + 2: TILE(2, 2); break;
    case 2 * 8 + 1: TILE(2, 1); break;
    case 1 * 8 + 4: TILE(1, 4); break;
    case 1 * 8 + 3: TILE(1, 3); break;
    case 1 * 8 + 2: TILE(1, 2); break;
    default: TILE(1, 1); break;
    }
#undef TILE
}

/* out (M, N) = xp @ wp^T: panels of NR weight groups handed to the threads on demand, each
 * panel's tiles over all M rows (the panel's weights stay in L2 while its rows pass). */
void bf16_matmul(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                 float *out) {
    const int64_t groups = N / LANES, pairs = K / 2;
    const int64_t panels = (groups + NR - 1) / NR;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t g0 = p * NR;
        const int nr = groups - g0 < NR ? (int)(groups - g0) : NR;
        for (int64_t i0 = 0; i0 < M; i0 += MR) {
            const int mr = M - i0 < MR ? (int)(M - i0) : MR;
            tile_any(xp, wp + g0 * pairs * LANES, pairs, N, i0, mr, nr, out + g0 * LANES);
        }
    }
}
#else
int bf16_matmul_available(void) { return 0; }

void bf16_matmul(const uint32_t *xp, int64_t M, const uint32_t *wp, int64_t N, int64_t K,
                 float *out) {
    (void)xp, (void)M, (void)wp, (void)N, (void)K, (void)out;
}
#endif
