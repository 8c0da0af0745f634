/* A few input rows times a row-major float32 or bfloat16 weight on the CPU (deepinfer_cpu/gemv.py and
 * decode_step.c call it): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x [M, K], w [N, K], out [M, N], all
 * contiguous; the projections of decode and verification steps.
 *
 * OpenMP splits the output rows n; each thread streams one weight row at a time (one sequential stream per
 * thread: two to four at once ran ~2× slower over a SmolLM2 step on the 2-core VM) against up to BLOCK input
 * rows, then again from L1 for the next BLOCK. Each (input row, weight row) pair keeps LANES = CHAINS × 16
 * partial sums: CHAINS independent FMA chains of 16-float vectors (GCC vector extensions: zmm registers with
 * AVX-512, pairs or quads of narrower ones elsewhere), folded by a fixed tree, then the K % LANES tail in
 * order. That order is the same whatever M is, so a row's result is bitwise the same alone or beside others:
 * a verification step's rows equal decode steps'. It is another order than a BLAS GEMV's. Any K.
 * scripts/bench_cpu_gemv_sweep.py measures it against oneDNN's packed GEMM at 1–8 rows.
 *
 * gemv_bf16: the same over a bfloat16 weight (half the bytes), each weight vector widened exactly to float32
 * where it is loaded (a 16-bit shift) and shared by the block's rows; x and out stay float32. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define CHAINS 4
#define LANES (CHAINS * 16)
#define BLOCK 4

typedef float floats16 __attribute__((vector_size(64), aligned(4)));     /* any 4-byte alignment */
typedef uint16_t halves16 __attribute__((vector_size(32), aligned(2)));  /* 16 bfloat16 */
typedef uint32_t words16 __attribute__((vector_size(64)));

static inline floats16 widen(const uint16_t *w) { /* 16 bfloat16 → float32, exactly */
    const words16 bits = __builtin_convertvector(*(const halves16 *)w, words16) << 16;
    floats16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline floats16 weights_at(const void *w, int64_t k, const int bf16) {
    return bf16 ? widen((const uint16_t *)w + k) : *(const floats16 *)((const float *)w + k);
}

static inline float weight_at(const void *w, int64_t k, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)w)[k]) : ((const float *)w)[k];
}

/* One pair's sum: its CHAINS vectors folded by the tree, then the tail [body, K) in order. */
static inline float fold(const floats16 *chains, const float *x, const void *w, int64_t body, int64_t K,
                         const int bf16) {
    const floats16 sum = (chains[0] + chains[1]) + (chains[2] + chains[3]);
    float lanes[16];
    memcpy(lanes, &sum, sizeof lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    float total = lanes[0];
    for (int64_t k = body; k < K; ++k) total += x[k] * weight_at(w, k, bf16);
    return total;
}

/* out[m * N] for m < rows: input rows x [rows, K] against one weight row w. rows and bf16 are constants at each
 * call below, so every inlined copy keeps its rows × CHAINS sums in registers. */
__attribute__((always_inline)) static inline void dot_block(const float *x, const void *w, float *out, int64_t N,
                                                            int64_t K, float bias, const int rows,
                                                            const int bf16) {
    const int64_t body = K - K % LANES;
    floats16 acc[BLOCK][CHAINS];
#pragma GCC unroll 4
    for (int m = 0; m < rows; ++m)
#pragma GCC unroll 4
        for (int c = 0; c < CHAINS; ++c) acc[m][c] = (floats16){0};
    for (int64_t k = 0; k < body; k += LANES) {
#pragma GCC unroll 4
        for (int c = 0; c < CHAINS; ++c) {
            const floats16 weights = weights_at(w, k + 16 * c, bf16);
#pragma GCC unroll 4
            for (int m = 0; m < rows; ++m) acc[m][c] += *(const floats16 *)(x + m * K + k + 16 * c) * weights;
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < rows; ++m) out[m * N] = fold(acc[m], x + m * K, w, body, K, bf16) + bias;
}

#define BLOCK_CASE(r)                                                                                          \
    case r:                                                                                                    \
        if (bf16)                                                                                              \
            dot_block(x + m0 * K, (const uint16_t *)w + n * K, out + m0 * N + n, N, K, b, r, 1);                \
        else                                                                                                   \
            dot_block(x + m0 * K, (const float *)w + n * K, out + m0 * N + n, N, K, b, r, 0);                   \
        break;

static void gemv(const float *x, const void *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                 int threads, int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += BLOCK) {
            switch (M - m0 < BLOCK ? M - m0 : BLOCK) {
                BLOCK_CASE(1)
                BLOCK_CASE(2)
                BLOCK_CASE(3)
                BLOCK_CASE(4)
            }
        }
    }
}

void gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
              int threads) {
    gemv(x, w, bias, out, M, N, K, threads, 0);
}

void gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
               int threads) {
    gemv(x, w, bias, out, M, N, K, threads, 1);
}
