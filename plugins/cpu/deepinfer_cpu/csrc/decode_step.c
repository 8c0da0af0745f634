/* A Llama-family decoder stack over a step of short query rows on the CPU, in one call
 * (deepinfer_cpu/decode_step.py loads it through ctypes; linked with gemv.c, paged_attention.c and quant_linear.c,
 * whose kernels it calls).
 *
 * Per layer, what deepinfer/model/llama.py computes: h = RMSNorm(x); qkv = W_qkv h (+ bias); (Qwen3: each head of q
 * and k RMS-normed); rope on q's and k's heads (rotate-half, the engine's cos and sign-folded sin tables); the
 * rows' keys and values stored at their cache slots and attended (paged_attention); x += W_o attn; h = RMSNorm(x);
 * g, u = W_gate_up h; x += W_down (silu(g) u). Each projection runs the kernel its GEMM backend runs for these rows
 * (struct projection: gemv_f32 / gemv_bf16 on a plain weight, or a quantized kernel of quant_linear.c), attention
 * paged_attention, each with its own OpenMP team; the rest (norms, rope, SiLU, residual adds: ~2,000 floats per row
 * and layer) runs on the calling thread, row by row, so a row's result does not depend on the rows beside it when
 * its kernels' do not. A batch-1 step through the Python layers spends ~5 ms of a ~20 ms token on the ~1,400 small
 * torch ops around its 120 projections (docs/benchmarks.md, issue 36); here they take microseconds.
 *
 * bf16 (plain weights, caches, the residual stream): every value the torch layers round to bfloat16 is rounded here
 * at the same point (round to nearest even), sums run in float32, so the two differ only in summation order.
 *
 * layers: the stack's layers (struct layer: norm weights and the bias as float32; the caches [blocks, block_size,
 * kv_heads, dim]). x_in [tokens, hidden] in the model dtype; x_out [tokens, hidden] receives the model's output
 * RMSNorm (final_norm: its weights as float32) of the residual stream leaving the last layer. captures: NULL, or
 * layers + 1 pointers (NULL or a [tokens, hidden] buffer in the model dtype) that receive the residual stream
 * entering each layer (index layers: leaving the last, before the output norm). Returns 0, or 1 when a buffer could
 * not be allocated (here or in a kernel). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stack_ops.h"

int paged_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                    const int64_t *seq_lens, const int64_t *starts, const int64_t *floors, float *out,
                    int64_t requests, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                    int64_t table_width, int64_t window, float scale, int threads, const void *new_k,
                    const void *new_v, const int64_t *slots, int64_t new_tokens, int bf16);

/* decode_step.py's _Layer and _Shape fill the same fields, in this order. */
struct layer {
    const float *input_norm, *post_norm, *qkv_bias;
    struct projection qkv, o_proj, gate_up, down;
    void *k_cache, *v_cache;
    const float *q_norm, *k_norm; /* per-head RMSNorm weights [head_dim] (Qwen3), or NULL */
};

struct shape {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int32_t bf16;
};

/* The step: tokens rows of requests requests, request r's rows [starts[r], starts[r + 1]) (the engine's
 * ForwardContext: positions, slots [tokens]; seq_lens [requests]; tables [requests, table_width]). */
struct step {
    int64_t tokens, requests, table_width;
    const int64_t *positions, *slots, *seq_lens, *starts, *tables;
};

/* Rotate-half rope of `heads` vectors of dim d in place: x·cos + roll(x, d/2)·sin_signed (sin's first half
 * negated, deepinfer/model/layers/rope.py). */
static void rope(float *x, int64_t heads, int64_t d, const float *cos_row, const float *sin_row, int bf16) {
    float rotated[d];
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h, x += d) {
        /* roll(x, d/2) in two copies: a modulo per element kept this loop scalar (0.44 ms of a six-row step) */
        memcpy(rotated, x + half, sizeof(float) * (size_t)(d - half));
        memcpy(rotated + (d - half), x, sizeof(float) * (size_t)half);
        for (int64_t i = 0; i < d; ++i) {
            const float turned = rotated[i] * sin_row[i], straight = x[i] * cos_row[i];
            x[i] = keep(turned + straight, bf16);
        }
    }
}

int decode_step(const struct shape *s, const struct layer *layers, const struct step *step, const void *x_in,
                void *x_out, const float *final_norm, const float *cos_table, const float *sin_table,
                void *const *captures, int threads) {
    const int bf16 = s->bf16;
    const int64_t T = step->tokens, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t hidden = s->hidden, inter = s->intermediate, qkv_size = q_size + 2 * kv_size;
    const int64_t widest = 2 * inter > qkv_size ? 2 * inter : qkv_size;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    /* per row: x (float32 residual), h (normed input), wide (qkv or gate/up), q, attn; new k and v in the cache
     * dtype (as floats: room for either) */
    const int64_t row = 2 * hidden + widest + 2 * q_size + 2 * kv_size;
    float *x = malloc(sizeof(float) * (size_t)(T * row));
    if (x == NULL) return 1;
    float *h = x + T * hidden, *wide = h + T * hidden, *q = wide + T * widest, *attn = q + T * q_size;
    void *new_k = attn + T * q_size, *new_v = (char *)new_k + element * (size_t)(T * kv_size);
    load(x, x_in, T * hidden, bf16);
    int failed = 0;
    for (int64_t l = 0; l < s->layers && !failed; ++l) {
        const struct layer *t = layers + l;
        if (captures != NULL && captures[l] != NULL) store(captures[l], x, T * hidden, bf16);
        for (int64_t r = 0; r < T; ++r) rms_norm(x + r * hidden, t->input_norm, h + r * hidden, hidden, s->eps, bf16);
        failed |= project(&t->qkv, h, t->qkv_bias, wide, T, qkv_size, hidden, threads, bf16);
        for (int64_t r = 0; r < T; ++r) {
            float *qkv = wide + r * qkv_size;
            const int64_t at = step->positions[r] * d;
            if (t->q_norm != NULL) /* Qwen3: each head of q and of k RMS-normed before rope */
                for (int64_t head = 0; head < s->heads + s->kv_heads; ++head) {
                    float *v = qkv + head * d;
                    rms_norm(v, head < s->heads ? t->q_norm : t->k_norm, v, d, s->eps, bf16);
                }
            rope(qkv, s->heads + s->kv_heads, d, cos_table + at, sin_table + at, bf16);
            memcpy(q + r * q_size, qkv, sizeof(float) * (size_t)q_size);
            store((char *)new_k + element * (size_t)(r * kv_size), qkv + q_size, kv_size, bf16);
            store((char *)new_v + element * (size_t)(r * kv_size), qkv + q_size + kv_size, kv_size, bf16);
        }
        failed |= paged_attention(q, t->k_cache, t->v_cache, step->tables, step->seq_lens, step->starts, NULL, attn,
                                  step->requests, s->heads, s->kv_heads, d, s->block_size, step->table_width, 0,
                                  s->scale, threads, new_k, new_v, step->slots, T, bf16);
        keep_all(attn, T * q_size, bf16);
        failed |= project(&t->o_proj, attn, NULL, h, T, hidden, q_size, threads, bf16);
        for (int64_t i = 0; i < T * hidden; ++i) x[i] = keep(x[i] + h[i], bf16);
        failed |= swiglu_mlp(x, h, wide, t->post_norm, &t->gate_up, &t->down, T, hidden, inter, s->eps, threads, bf16);
    }
    if (!failed) {
        if (captures != NULL && captures[s->layers] != NULL) store(captures[s->layers], x, T * hidden, bf16);
        for (int64_t r = 0; r < T; ++r) rms_norm(x + r * hidden, final_norm, h + r * hidden, hidden, s->eps, bf16);
        store(x_out, h, T * hidden, bf16);
    }
    free(x);
    return failed;
}
