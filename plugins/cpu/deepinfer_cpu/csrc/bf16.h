/* bfloat16 <-> float32 for the plugin's kernels (included by gemv.c, paged_attention.c, stack_ops.h). */
#ifndef DEEPINFER_CPU_BF16_H
#define DEEPINFER_CPU_BF16_H
#include <stdint.h>

/* A bfloat16's value, exactly (its bits are a float32's high half). */
static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

/* f rounded to bfloat16, to nearest even, as torch's .to(bfloat16); a NaN stays a NaN. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
#endif
