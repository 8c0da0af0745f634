/* One input row times a row-major float32 weight on the CPU (deepinfer_cpu/gemv.py loads it through ctypes):
 * out[n] = sum_k x[k] * w[n, k] (+ bias[n]), w [N, K] contiguous, the batch-1 decode step's every projection.
 *
 * OpenMP splits the output rows; each task takes ROWS rows at a time and keeps LANES partial sums per row in
 * SIMD lanes across the whole of K (one horizontal sum per row, at the end). ROWS 1 and LANES 16 (one weight
 * stream per thread) were the best of 1/2/4/8 × 16/32/64 over a whole SmolLM2 step's 121 projections with
 * distinct weights, so that every call reads memory: 13.5 ms, 39.6 GB/s on the 2-core VM, against 15.2–15.6
 * ms for 8 × 32, chosen earlier from repeated calls on one weight (which stays in L3). Sums run in float32
 * lanes (another order than a BLAS GEMV). Any K.
 *
 * gemv_bf16: the same over a bfloat16 weight (half the bytes), each weight widened exactly to float32 where
 * it is loaded (a 16-bit shift); x and out stay float32. */
#include <stdint.h>

#include "bf16.h"

#ifndef ROWS /* -DROWS=… -DLANES=…: scripts/bench_cpu_gemv_sweep.py */
#define ROWS 1
#endif
#ifndef LANES
#define LANES 16
#endif

static inline float weight_at(const void *w, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Output rows [n0, n0 + rows): LANES partial sums per row across K, then one horizontal sum each. bf16 is a
 * constant at each call below, so each inlined copy is a loop of one weight type. */
static inline void dot_rows(const float *x, const void *w, const float *bias, float *out, int64_t n0, int64_t rows,
                            int64_t K, const int bf16) {
    const int64_t body = K - K % LANES;
    float acc[ROWS][LANES] = {{0.0f}};
    for (int64_t k = 0; k < body; k += LANES) {
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = (n0 + r) * K + k;
#pragma omp simd
            for (int l = 0; l < LANES; ++l) acc[r][l] += x[k + l] * weight_at(w, at + l, bf16);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int l = 0; l < LANES; ++l) total += acc[r][l];
        for (int64_t k = body; k < K; ++k) total += x[k] * weight_at(w, (n0 + r) * K + k, bf16);
        out[n0 + r] = total + (bias ? bias[n0 + r] : 0.0f);
    }
}

static void gemv(const float *x, const void *w, const float *bias, float *out, int64_t N, int64_t K, int threads,
                 int bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
        const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
        if (bf16)
            dot_rows(x, w, bias, out, n0, rows, K, 1);
        else
            dot_rows(x, w, bias, out, n0, rows, K, 0);
    }
}

void gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t N, int64_t K, int threads) {
    gemv(x, w, bias, out, N, K, threads, 0);
}

void gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *out, int64_t N, int64_t K,
               int threads) {
    gemv(x, w, bias, out, N, K, threads, 1);
}
