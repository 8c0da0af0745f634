/* Weight-only quantized linear layers on the CPU, float32 activations (deepinfer_cpu/quant_linear.py loads
 * it through ctypes): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w stored in one of two formats.
 *
 *   int8:  w[n, k] = scale[n, k / group] * q[n, k]; q int8 [N, K], scale float32 [N, K / group] (group = K:
 *          one scale per output row; group = 32: llama.cpp's Q8_0 blocks).
 *   q4_1:  blocks of 32 inputs along k, as llama.cpp's Q4_1: w[n, 32 b + j] = d[n, b] * q + mn[n, b] with q the
 *          low nibble of qs[n, 16 b + j] for j < 16 and the high nibble of qs[n, 16 b + j - 16] for j >= 16;
 *          qs uint8 [N, K / 2], d and mn float16 [N, K / 32] (5 bits per weight, as in a GGUF file).
 *
 * One input row (M = 1, a batch-1 decode step) takes a fused matrix-vector loop: each weight is converted
 * and multiplied where it is loaded, the scale applied once per block (q4_1's minimum through the block's
 * input sum: sum_j x_j (d q_j + m) = d sum_j x_j q_j + m sum_j x_j). Several input rows: each OpenMP task
 * takes ROWS output rows, expands their weights to float32 once into a small buffer (L1), then runs every
 * input row against them, so the quantized weight is read from memory once per call and expanded once per
 * call, whatever M is. Sums run in float32 in SIMD lanes (another order than a BLAS GEMM).
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

/* M = 1: out[n] = sum over blocks of scale * (x . q) (+ bias). The sums stay in 16 lanes across blocks (the
 * block's scale folded into each lane's product), so no block pays a horizontal reduction. */
static void gemv_int8(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                      int64_t N, int64_t K, int64_t group, int threads) {
    const int64_t blocks = K / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t *row = q + n * K;
        float total = 0.0f;
        if (group % 16 == 0 && blocks > 1) {
            float lanes[16] = {0.0f};
            for (int64_t b = 0; b < blocks; ++b) {
                const float s = scale[n * blocks + b];
                for (int64_t j = b * group; j < (b + 1) * group; j += 16) {
#pragma omp simd
                    for (int l = 0; l < 16; ++l) lanes[l] += s * (x[j + l] * (float)row[j + l]);
                }
            }
            for (int l = 0; l < 16; ++l) total += lanes[l];
        } else {
            for (int64_t b = 0; b < blocks; ++b) {
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t j = b * group; j < (b + 1) * group; ++j) acc += x[j] * (float)row[j];
                total += acc * scale[n * blocks + b];
            }
        }
        out[n] = total + (bias ? bias[n] : 0.0f);
    }
}

/* M = 1, q4_1: per block d * (x . q) + m * sum(x); xsum [K / 32] holds the block sums of x. Lanes as above. */
static void gemv_q4_1(const float *x, const float *xsum, const uint8_t *qs, const _Float16 *d, const _Float16 *mn,
                      const float *bias, float *out, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        float lanes[16] = {0.0f}, low = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *src = qs + n * (K / 2) + 16 * b;
            const float *xb = x + 32 * b;
            const float step = (float)d[n * blocks + b];
#pragma omp simd
            for (int l = 0; l < 16; ++l)
                lanes[l] += step * (xb[l] * (float)(src[l] & 15) + xb[l + 16] * (float)(src[l] >> 4));
            low += (float)mn[n * blocks + b] * xsum[b];
        }
        float total = low;
        for (int l = 0; l < 16; ++l) total += lanes[l];
        out[n] = total + (bias ? bias[n] : 0.0f);
    }
}

/* A quantized weight matrix in one of the two formats (the header comment's fields). */
typedef enum { INT8, Q4_1 } Format;
typedef struct {
    Format format;
    const int8_t *q;
    const float *scale;
    int64_t group;
    const uint8_t *qs;
    const _Float16 *d;
    const _Float16 *mn;
} Weights;

static void expand_row(const Weights *wt, int64_t n, int64_t K, float *dst) {
    if (wt->format == INT8)
        expand_int8_row(wt->q + n * K, wt->scale + n * (K / wt->group), K, wt->group, dst);
    else
        expand_q4_1_row(wt->qs + n * (K / 2), wt->d + n * (K / 32), wt->mn + n * (K / 32), K, dst);
}

/* Several input rows: each task expands ROWS output rows' weights once, then runs every input row on them. */
static int expand_and_multiply(const float *x, const Weights *wt, const float *bias, float *out, int64_t M,
                               int64_t N, int64_t K, int threads) {
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
            for (int64_t r = 0; r < rows; ++r) expand_row(wt, n0 + r, K, w + r * K);
            multiply(x, w, bias, out, M, N, K, n0, rows);
        }
        free(w);
    }
    return failed;
}

int linear_int8_f32(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                    int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    if (M == 1) {
        gemv_int8(x, q, scale, bias, out, N, K, group, threads);
        return 0;
    }
    const Weights wt = {INT8, q, scale, group, NULL, NULL, NULL};
    return expand_and_multiply(x, &wt, bias, out, M, N, K, threads);
}

int linear_q4_1_f32(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                    float *out, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
    if (M == 1) {
        float *xsum = malloc(sizeof(float) * (size_t)blocks);
        if (xsum == NULL) return 1;
        for (int64_t b = 0; b < blocks; ++b) {
            float acc = 0.0f;
            for (int j = 0; j < 32; ++j) acc += x[32 * b + j];
            xsum[b] = acc;
        }
        gemv_q4_1(x, xsum, qs, d, mn, bias, out, N, K, threads);
        free(xsum);
        return 0;
    }
    const Weights wt = {Q4_1, NULL, NULL, 0, qs, d, mn};
    return expand_and_multiply(x, &wt, bias, out, M, N, K, threads);
}
