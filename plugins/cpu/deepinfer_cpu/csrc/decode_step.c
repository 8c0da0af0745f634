/* A whole Llama-family decoder stack for one decode row on the CPU, in one call (deepinfer_cpu/decode_step.py
 * loads it through ctypes; linked with gemv.c and paged_attention.c, whose kernels it calls).
 *
 * Per layer, what deepinfer/model/llama.py computes: h = RMSNorm(x); qkv = W_qkv h (+ bias); rope on q's and
 * k's heads (rotate-half, the engine's cos and sign-folded sin tables); the row's key and value stored at its
 * cache slot and attended (paged_attention); x += W_o attn; h = RMSNorm(x); g, u = W_gate_up h;
 * x += W_down (silu(g) u). The projections run gemv_f32 / gemv_bf16, attention paged_attention, each with its
 * own OpenMP team; the rest (norms, rope, SiLU, residual adds: ~2,000 floats a layer) runs on the calling
 * thread. A batch-1 step through the Python layers spends ~5 ms of a ~20 ms token on the ~1,400 small torch ops
 * around its 120 projections (docs/benchmarks.md, issue 36); here they are a few microseconds.
 *
 * bf16 (weights, caches, the residual stream): every value the torch layers round to bfloat16 is rounded here
 * at the same point (round to nearest even), sums run in float32, so the two differ only in summation order.
 *
 * plan: per layer LAYER_TENSORS pointers in the order of enum tensor (norm weights and the bias as float32
 * copies; matrices row-major float32 or bf16; the caches [blocks, block_size, kv_heads, dim]).
 * captures: NULL, or layers + 1 pointers (NULL or a [hidden] buffer in the model dtype) that receive the
 * residual stream entering each layer (index layers: leaving the last).
 * table: the request's block table (one row: its width is not needed).
 * Returns 0, 1 when a buffer could not be allocated, or what paged_attention returned. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t N, int64_t K, int threads);
void gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *out, int64_t N, int64_t K, int threads);
int paged_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                    const int64_t *seq_lens, const int64_t *starts, const int64_t *floors, float *out,
                    int64_t requests, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                    int64_t table_width, int64_t window, float scale, int threads, const void *new_k,
                    const void *new_v, const int64_t *slots, int64_t new_tokens, int bf16);

enum tensor { INPUT_NORM, QKV, QKV_BIAS, O_PROJ, POST_NORM, GATE_UP, DOWN, K_CACHE, V_CACHE, LAYER_TENSORS };

/* The stack's shape (decode_step.py fills the same fields, in this order). */
struct shape {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int32_t bf16;
};

static inline uint16_t bf16_bits(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)b << 16};
    return v.f;
}

/* v as the torch layers hold it: rounded to bfloat16 in a bf16 model, as it is in a float32 one. */
static inline float keep(float v, int bf16) { return bf16 ? from_bf16(bf16_bits(v)) : v; }

static void keep_all(float *v, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; ++i) v[i] = keep(v[i], 1);
}

/* RMSNorm: statistics in float32, then weight * (x / rms) with the quotient kept in the model dtype first. */
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps, int bf16) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = keep(weight[i] * keep(x[i] * inv, bf16), bf16);
}

/* Rotate-half rope of `heads` vectors of dim d in place: x·cos + roll(x, d/2)·sin_signed (sin's first half
 * negated, deepinfer/model/layers/rope.py). */
static void rope(float *x, int64_t heads, int64_t d, const float *cos_row, const float *sin_row, int bf16) {
    float rotated[d];
    for (int64_t h = 0; h < heads; ++h, x += d) {
        for (int64_t i = 0; i < d; ++i) rotated[i] = x[(i + d / 2) % d];
        for (int64_t i = 0; i < d; ++i) {
            const float turned = rotated[i] * sin_row[i], straight = x[i] * cos_row[i];
            x[i] = keep(turned + straight, bf16);
        }
    }
}

static void project(const float *in, const void *w, const float *bias, float *out, int64_t n, int64_t k,
                    int threads, int bf16) {
    if (bf16)
        gemv_bf16(in, w, bias, out, n, k, threads);
    else
        gemv_f32(in, w, bias, out, n, k, threads);
    keep_all(out, n, bf16);
}

static void store(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)dst)[i] = bf16_bits(src[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

int decode_step(const struct shape *s, const void *const *plan, const void *x_in, void *x_out,
                const float *cos_table, const float *sin_table, const int64_t *position, const int64_t *slot,
                const int64_t *seq_len, const int64_t *table, void *const *captures, int threads) {
    const int bf16 = s->bf16;
    const int64_t d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d, hidden = s->hidden;
    const int64_t qkv_size = q_size + 2 * kv_size, widest = s->intermediate * 2 > qkv_size ? s->intermediate * 2
                                                                                           : qkv_size;
    const int64_t starts[2] = {0, 1};
    /* x (float32 residual), h (normed input), wide (qkv or gate/up), attn, new k/v in the cache dtype */
    float *x = malloc(sizeof(float) * (size_t)(2 * hidden + widest + q_size + 2 * kv_size));
    if (x == NULL) return 1;
    float *h = x + hidden, *wide = h + hidden, *attn = wide + widest;
    void *new_kv = attn + q_size;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t i = 0; i < hidden; ++i)
        x[i] = bf16 ? from_bf16(((const uint16_t *)x_in)[i]) : ((const float *)x_in)[i];
    const float *cos_row = cos_table + *position * d, *sin_row = sin_table + *position * d;
    int failed = 0;
    for (int64_t l = 0; l < s->layers && !failed; ++l) {
        const void *const *t = plan + l * LAYER_TENSORS;
        if (captures != NULL && captures[l] != NULL) store(captures[l], x, hidden, bf16);
        rms_norm(x, t[INPUT_NORM], h, hidden, s->eps, bf16);
        project(h, t[QKV], t[QKV_BIAS], wide, qkv_size, hidden, threads, bf16);
        rope(wide, s->heads + s->kv_heads, d, cos_row, sin_row, bf16);
        store(new_kv, wide + q_size, kv_size, bf16);
        store((char *)new_kv + element * (size_t)kv_size, wide + q_size + kv_size, kv_size, bf16);
        failed = paged_attention(wide, t[K_CACHE], t[V_CACHE], table, seq_len, starts, NULL, attn, 1, s->heads,
                                 s->kv_heads, d, s->block_size, 0, 0, s->scale, threads, new_kv,
                                 (char *)new_kv + element * (size_t)kv_size, slot, 1, bf16);
        keep_all(attn, q_size, bf16);
        project(attn, t[O_PROJ], NULL, h, hidden, q_size, threads, bf16);
        for (int64_t i = 0; i < hidden; ++i) x[i] = keep(x[i] + h[i], bf16);
        rms_norm(x, t[POST_NORM], h, hidden, s->eps, bf16);
        project(h, t[GATE_UP], NULL, wide, 2 * s->intermediate, hidden, threads, bf16);
        for (int64_t i = 0; i < s->intermediate; ++i) {
            const float g = wide[i];
            wide[i] = keep(keep(g / (1.0f + expf(-g)), bf16) * wide[s->intermediate + i], bf16);
        }
        project(wide, t[DOWN], NULL, h, hidden, s->intermediate, threads, bf16);
        for (int64_t i = 0; i < hidden; ++i) x[i] = keep(x[i] + h[i], bf16);
    }
    if (!failed) {
        if (captures != NULL && captures[s->layers] != NULL) store(captures[s->layers], x, hidden, bf16);
        store(x_out, x, hidden, bf16);
    }
    free(x);
    return failed;
}
