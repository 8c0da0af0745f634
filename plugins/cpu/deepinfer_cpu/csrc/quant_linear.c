/* Weight-only quantized linear layers on the CPU, float32 activations (deepinfer_cpu/quant_linear.py loads
 * it through ctypes): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w stored in one of two formats.
 *
 *   int8:  w[n, k] = scale[n, k / group] * q[n, k]; q int8 [N, K], scale float32 [N, K / group] (group = K:
 *          one scale per output row; group = 32: llama.cpp's Q8_0 blocks).
 *   q4_1:  blocks of 32 inputs along k, as llama.cpp's Q4_1: w[n, 32 b + j] = d[n, b] * q + mn[n, b] with q the
 *          low nibble of qs[n, 16 b + j] for j < 16 and the high nibble of qs[n, 16 b + j - 16] for j >= 16;
 *          qs uint8 [N, K / 2], d and mn float16 [N, K / 32] (5 bits per weight, as in a GGUF file).
 *
 * Each OpenMP task takes ROWS output rows: it expands their weights to float32 once into a small buffer (L1),
 * then runs every input row against them, so the quantized weight is read from memory once per call and
 * expanded once per call, whatever M is. Sums run in float32 in SIMD lanes (another order than a BLAS GEMM).
 * K must be a multiple of group (int8) or of 32 (q4_1); the caller checks. Functions return 0, or 1 when a
 * buffer could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>

#define ROWS 4

static void expand_int8_row(const int8_t *q, const float *scale, int64_t K, int64_t group, float *dst) {
    for (int64_t b = 0; b < K / group; ++b) {
        const int8_t *src = q + group * b;
        float *out = dst + group * b;
        const float s = scale[b];
#pragma omp simd
        for (int64_t j = 0; j < group; ++j) out[j] = s * (float)src[j];
    }
}

static void expand_q4_1_row(const uint8_t *qs, const _Float16 *d, const _Float16 *mn, int64_t K, float *dst) {
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t *src = qs + 16 * b;
        float *out = dst + 32 * b;
        const float scale = (float)d[b], low = (float)mn[b];
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
            out[j] = scale * (float)(src[j] & 15) + low;
            out[j + 16] = scale * (float)(src[j] >> 4) + low;
        }
    }
}

/* out rows [n0, n0 + rows) of every input row, from the expanded weights w [rows][K]. */
static void multiply(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int64_t n0, int64_t rows) {
    for (int64_t m = 0; m < M; ++m) {
        const float *xm = x + m * K;
        if (rows == ROWS) {
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t k = 0; k < K; ++k) {
                const float v = xm[k];
                a0 += v * w0[k];
                a1 += v * w1[k];
                a2 += v * w2[k];
                a3 += v * w3[k];
            }
            float *o = out + m * N + n0;
            o[0] = a0 + (bias ? bias[n0] : 0.0f);
            o[1] = a1 + (bias ? bias[n0 + 1] : 0.0f);
            o[2] = a2 + (bias ? bias[n0 + 2] : 0.0f);
            o[3] = a3 + (bias ? bias[n0 + 3] : 0.0f);
        } else {
            for (int64_t r = 0; r < rows; ++r) {
                float acc = 0.0f;
                const float *wr = w + r * K;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; ++k) acc += xm[k] * wr[k];
                out[m * N + n0 + r] = acc + (bias ? bias[n0 + r] : 0.0f);
            }
        }
    }
}

int linear_int8_f32(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                    int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = malloc(sizeof(float) * (size_t)(ROWS * K));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
            if (w == NULL) continue;
            const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t n = n0 + r;
                expand_int8_row(q + n * K, scale + n * (K / group), K, group, w + r * K);
            }
            multiply(x, w, bias, out, M, N, K, n0, rows);
        }
        free(w);
    }
    return failed;
}

int linear_q4_1_f32(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                    float *out, int64_t M, int64_t N, int64_t K, int threads) {
    int failed = 0;
    const int64_t blocks = K / 32;
#pragma omp parallel num_threads(threads)
    {
        float *w = malloc(sizeof(float) * (size_t)(ROWS * K));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
            if (w == NULL) continue;
            const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t n = n0 + r;
                expand_q4_1_row(qs + n * (K / 2), d + n * blocks, mn + n * blocks, K, w + r * K);
            }
            multiply(x, w, bias, out, M, N, K, n0, rows);
        }
        free(w);
    }
    return failed;
}
