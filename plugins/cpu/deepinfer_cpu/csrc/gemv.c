/* A few input rows times a row-major float32 or bfloat16 weight on the CPU (deepinfer_cpu/gemv.py and
 * decode_step.c call it): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x [M, K], w [N, K], out [M, N], all
 * contiguous; the projections of decode and verification steps.
 *
 * OpenMP splits the output rows n; each thread streams one weight row at a time (one sequential stream per
 * thread: two to four at once ran ~2× slower over a SmolLM2 step on the 2-core VM) against up to BLOCK input
 * rows, then again from L1 for the next BLOCK. Each (input row, weight row) pair keeps 64 partial sums in
 * independent FMA chains of SIMD vectors (GCC vector extensions), folded by a fixed tree, then the K % 64 tail
 * in order. That order is the same whatever M is, so a row's result is bitwise the same alone or beside others:
 * a verification step's rows equal decode steps'. It is another order than a BLAS GEMV's. Any K.
 * The vector width is the dtype's: float32 weights 8 chains of 8-float (ymm) vectors, bf16 weights 4 chains of
 * 16-float (zmm with AVX-512) vectors — on the 2-core AMD VM 16-float vectors ran a one-row float32 step 5–15%
 * slower and 8-float ones a bf16 step ~20% slower end to end. scripts/bench_cpu_gemv_sweep.py measures it
 * against oneDNN's packed GEMM at 1–8 rows.
 *
 * gemv_bf16: each bf16 weight vector is widened exactly to float32 where it is loaded (a 16-bit shift) and
 * shared by the block's rows; x and out stay float32. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define LANES 64
#define BLOCK 4

typedef float floats8 __attribute__((vector_size(32), aligned(4)));     /* any 4-byte alignment */
typedef float floats16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t halves16 __attribute__((vector_size(32), aligned(2)));  /* 16 bfloat16 */
typedef uint32_t words16 __attribute__((vector_size(64)));

static inline floats16 widen(const uint16_t *w) { /* 16 bfloat16 → float32, exactly */
    const words16 bits = __builtin_convertvector(*(const halves16 *)w, words16) << 16;
    floats16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One pair's vector sums into total: the chains folded pairwise (chain c += chain c + width, width halving), then
 * the vector's lanes likewise (the caller adds the K % LANES tail). */
#define FOLD(WIDTH, CHAINS, chains, total)                                                                     \
    do {                                                                                                       \
        for (int width = (CHAINS) / 2; width > 0; width /= 2)                                                  \
            for (int c = 0; c < width; ++c) chains[c] += chains[c + width];                                    \
        float lanes[WIDTH];                                                                                    \
        memcpy(lanes, &chains[0], sizeof lanes);                                                               \
        for (int width = (WIDTH) / 2; width > 0; width /= 2)                                                   \
            for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];                                      \
        total = lanes[0];                                                                                      \
    } while (0)

/* NAME(x, w, out, N, K, bias, rows): out[m * N] for m < rows, input rows x [rows, K] against one weight row w of
 * WEIGHT elements, in CHAINS chains of VEC vectors (WIDTH floats) loaded by LOAD(w + k) and folded by FOLD, then
 * the tail in order through SCALAR(w[k]). rows is a constant at each call below, so every inlined copy keeps its
 * rows × CHAINS sums in registers. */
#define DOT_BLOCK(NAME, WEIGHT, VEC, WIDTH, CHAINS, LOAD, SCALAR)                                              \
    __attribute__((always_inline)) static inline void NAME(const float *x, const WEIGHT *w, float *out,       \
                                                           int64_t N, int64_t K, float bias, const int rows) { \
        const int64_t body = K - K % LANES;                                                                    \
        VEC acc[BLOCK][CHAINS];                                                                                \
        _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)                                                 \
            _Pragma("GCC unroll 8") for (int c = 0; c < (CHAINS); ++c) acc[m][c] = (VEC){0};                   \
        for (int64_t k = 0; k < body; k += LANES) {                                                            \
            _Pragma("GCC unroll 8") for (int c = 0; c < (CHAINS); ++c) {                                       \
                const VEC weights = LOAD(w + k + (WIDTH) * c);                                                 \
                _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)                                         \
                    acc[m][c] += *(const VEC *)(x + m * K + k + (WIDTH) * c) * weights;                        \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m) {                                               \
            float total;                                                                                       \
            FOLD(WIDTH, CHAINS, acc[m], total);                                                                \
            for (int64_t k = body; k < K; ++k) total += x[m * K + k] * SCALAR(w[k]);                           \
            out[m * N] = total + bias;                                                                         \
        }                                                                                                      \
    }

#define LOAD_F32(p) (*(const floats8 *)(p))
#define AS_FLOAT(v) (v)
DOT_BLOCK(dot_block_f32, float, floats8, 8, 8, LOAD_F32, AS_FLOAT)
DOT_BLOCK(dot_block_bf16, uint16_t, floats16, 16, 4, widen, bf16_to_float)

#define BLOCK_CASE(r)                                                                                          \
    case r:                                                                                                    \
        if (bf16)                                                                                              \
            dot_block_bf16(x + m0 * K, (const uint16_t *)w + n * K, out + m0 * N + n, N, K, b, r);             \
        else                                                                                                   \
            dot_block_f32(x + m0 * K, (const float *)w + n * K, out + m0 * N + n, N, K, b, r);                 \
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
