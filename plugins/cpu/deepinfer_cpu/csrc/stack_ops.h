/* What the fused stacks share (included by decode_step.c and draft_step.c): the projections' kernels (gemv.c,
 * quant_linear.c), a weight as its kernel takes it, and the steps between kernels with the torch layers' rounding
 * (a bf16 model's values rounded to bfloat16 where the torch layers round them; sums in float32). */
#ifndef DEEPINFER_CPU_STACK_OPS_H
#define DEEPINFER_CPU_STACK_OPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fastexp.h"

void gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
              int threads);
void gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
               int threads);
int linear_int8_f32(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                    int64_t M, int64_t N, int64_t K, int64_t group, int threads);
int linear_int8_q8(const float *x, const int8_t *q, const float *scale, const float *bias, float *out, int64_t M,
                   int64_t N, int64_t K, int64_t group, int threads);
int linear_q4_1_f32(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                    float *out, int64_t M, int64_t N, int64_t K, int threads);
int linear_q4_1_q8(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                   float *out, int64_t M, int64_t N, int64_t K, int threads);

/* A weight as its kernel takes it: plain (a: the [N, K] matrix), int8 (a: codes, b: scales, group), q4_1 (a:
 * nibbles, b: steps, c: minima); *_Q8 kinds round the inputs to int8 blocks first (quant_linear.c). */
enum kind { PLAIN_F32, PLAIN_BF16, INT8_F32, INT8_Q8, Q4_1_F32, Q4_1_Q8 };

struct projection {
    int64_t kind, group;
    const void *a, *b, *c;
};

/* v as the torch layers hold it: rounded to bfloat16 in a bf16 model, as it is in a float32 one. */
static inline float keep(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

static inline void keep_all(float *v, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; ++i) v[i] = keep(v[i], 1);
}

/* RMSNorm: statistics in float32, then weight * (x / rms) with the quotient kept in the model dtype first. */
static inline void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps, int bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum) /* in vector lanes (a chain of n dependent additions took ~1 µs a row) */
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = keep(weight[i] * keep(x[i] * inv, bf16), bf16);
}

/* out [rows, n] = in [rows, k] Wᵀ (+ bias) through the weight's kernel, kept as the torch layers keep it. */
static inline int project(const struct projection *w, const float *in, const float *bias, float *out, int64_t rows,
                   int64_t n, int64_t k, int threads, int bf16) {
    int failed = 0;
    switch (w->kind) {
    case PLAIN_F32: gemv_f32(in, w->a, bias, out, rows, n, k, threads); break;
    case PLAIN_BF16: gemv_bf16(in, w->a, bias, out, rows, n, k, threads); break;
    case INT8_F32: failed = linear_int8_f32(in, w->a, w->b, bias, out, rows, n, k, w->group, threads); break;
    case INT8_Q8: failed = linear_int8_q8(in, w->a, w->b, bias, out, rows, n, k, w->group, threads); break;
    case Q4_1_F32: failed = linear_q4_1_f32(in, w->a, w->b, w->c, bias, out, rows, n, k, threads); break;
    case Q4_1_Q8: failed = linear_q4_1_q8(in, w->a, w->b, w->c, bias, out, rows, n, k, threads); break;
    default: failed = 1;
    }
    keep_all(out, rows * n, bf16);
    return failed;
}

/* A pre-norm SwiGLU MLP over T rows of the residual stream x [T, hidden], in place: x += W_down (silu(g) · u) with
 * g, u = W_gate_up RMSNorm(x) (norm: its weights). h [T, hidden] and wide [T, 2 · inter] are scratch. Returns
 * nonzero when a kernel failed. */
static inline int swiglu_mlp(float *x, float *h, float *wide, const float *norm, const struct projection *gate_up,
                             const struct projection *down, int64_t T, int64_t hidden, int64_t inter, float eps,
                             int threads, int bf16) {
    for (int64_t r = 0; r < T; ++r) rms_norm(x + r * hidden, norm, h + r * hidden, hidden, eps, bf16);
    int failed = project(gate_up, h, NULL, wide, T, 2 * inter, hidden, threads, bf16);
    for (int64_t r = 0; r < T; ++r) { /* silu(gate) · up, packed into the row's first half */
        float *gu = wide + r * 2 * inter, *act = wide + r * inter;
        /* act[i] is written after gu[i] and gu[inter + i] are read, and act lies at or before gu: no element is
         * read after it was written, so the loop vectorizes (GCC cannot see that and kept it scalar: 0.34 of a
         * six-row SmolLM2 step's 11.6 ms) */
#pragma GCC ivdep
        for (int64_t i = 0; i < inter; ++i) act[i] = keep(keep(silu(gu[i]), bf16) * gu[inter + i], bf16);
    }
    failed |= project(down, wide, NULL, h, T, hidden, inter, threads, bf16);
    for (int64_t i = 0; i < T * hidden; ++i) x[i] = keep(x[i] + h[i], bf16);
    return failed;
}

static inline void store(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

static inline void load(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

#endif
