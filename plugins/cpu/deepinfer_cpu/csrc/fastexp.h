/* e^x for x <= 0 in plain C that vectorizes (included by paged_attention.c and stack_ops.h): glibc's expf is a
 * scalar call without -ffast-math, and a decode step calls it for every attention score and every MLP activation.
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its degree-6 Taylor polynomial (relative error
 * below 2e-7), times 2^n built in the exponent bits. Below -87 (e^x under float32's normal range; masked scores
 * are -inf) it returns 0. */
#ifndef DEEPINFER_CPU_FASTEXP_H
#define DEEPINFER_CPU_FASTEXP_H
#include <math.h>
#include <stdint.h>

static inline float exp_nonpositive(float x) {
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* x · sigmoid(x), through e = e^-|x|: sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}
#endif
