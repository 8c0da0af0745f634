/* A Llama-family decoder stack over a step on the CPU, in one call
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
 * torch ops around its 120 projections (docs/benchmarks.md, issue 36); here they take microseconds. That is
 * layers_through_kernels; steps of more rows than the kernels take go through layers_through_caller: the same
 * computation with the projections (and a long prompt chunk's attention) called back into the caller (struct
 * caller), the loops between them spread over the threads.
 *
 * bf16 (plain weights, caches, the residual stream): every value the torch layers round to bfloat16 is rounded here
 * at the same point (round to nearest even), sums run in float32, so the two differ only in summation order.
 *
 * layers: the stack's layers (struct layer: norm weights and the bias as float32; the caches [blocks, block_size,
 * kv_heads, dim]). x_in [tokens, hidden] in the model dtype; x_out [tokens, hidden] receives the model's output
 * RMSNorm (final_norm: its weights as float32) of the residual stream leaving the last layer. captures: NULL, or
 * layers + 1 pointers (NULL or a [tokens, hidden] buffer in the model dtype) that receive the residual stream
 * entering each layer (index layers: leaving the last, before the output norm). Returns 0, or 1 when a buffer could
 * not be allocated (here or in a kernel) or a call back failed. */
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

/* A call back into the caller (decode_step.py): call(id, rows, input) computes and points `out` at its result, in
 * the model dtype; nonzero when it failed. A projection: id 4 · layer + 0 (qkv), 1 (o_proj), 2 (gate_up), 3 (down)
 * times input [rows, K], bias included. Attention: id the layer; it reads q [rows, heads · d] and the new keys
 * and values k, v [rows, kv_heads · d] (model dtype), stores those in the layer's cache and attends (input NULL). */
struct caller {
    int (*call)(int64_t id, int64_t rows, const void *input);
    const void *out;
    void *q, *k, *v;
};

/* The step: tokens rows of requests requests, request r's rows [starts[r], starts[r + 1]) (the engine's
 * ForwardContext: positions, slots [tokens]; seq_lens [requests]; tables [requests, table_width]). With a
 * `projection` caller the projections are the caller's (layers_through_caller) and `workspace` holds
 * decode_step_workspace's bytes; with an `attention` caller so is attention. */
struct step {
    int64_t tokens, requests, table_width;
    const int64_t *positions, *slots, *seq_lens, *starts, *tables;
    const struct caller *projection, *attention;
    void *workspace;
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

/* One row's q, k, v after the qkv projection (qkv [q_size + 2 · kv_size], float32, in place): Qwen3's per-head
 * norms, rope at the row's position; q to q_row (float32), k and v to k_row, v_row in the cache dtype. */
static void place_row(const struct shape *s, const struct layer *t, float *qkv, int64_t position,
                      const float *cos_table, const float *sin_table, float *q_row, void *k_row, void *v_row) {
    const int64_t d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    if (t->q_norm != NULL) /* Qwen3: each head of q and of k RMS-normed before rope */
        for (int64_t head = 0; head < s->heads + s->kv_heads; ++head) {
            float *v = qkv + head * d;
            rms_norm(v, head < s->heads ? t->q_norm : t->k_norm, v, d, s->eps, s->bf16);
        }
    rope(qkv, s->heads + s->kv_heads, d, cos_table + position * d, sin_table + position * d, s->bf16);
    memcpy(q_row, qkv, sizeof(float) * (size_t)q_size);
    store(k_row, qkv + q_size, kv_size, s->bf16);
    store(v_row, qkv + q_size + kv_size, kv_size, s->bf16);
}

/* The layers through the kernels: steps of the few rows they take (decode_step.py's max_rows), each loop between
 * them on the calling thread. */
static int layers_through_kernels(const struct shape *s, const struct layer *layers, const struct step *step, float *x,
                                  void *const *captures, const float *cos_table, const float *sin_table, int threads) {
    const int bf16 = s->bf16;
    const int64_t T = step->tokens, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t hidden = s->hidden, inter = s->intermediate, qkv_size = q_size + 2 * kv_size;
    const int64_t widest = 2 * inter > qkv_size ? 2 * inter : qkv_size;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    /* per row: h (normed input), wide (qkv or gate/up), q, attn; new k and v in the cache dtype (as floats: room
     * for either) */
    float *h = malloc(sizeof(float) * (size_t)(T * (hidden + widest + 2 * q_size + 2 * kv_size)));
    if (h == NULL) return 1;
    float *wide = h + T * hidden, *q = wide + T * widest, *attn = q + T * q_size;
    void *new_k = attn + T * q_size, *new_v = (char *)new_k + element * (size_t)(T * kv_size);
    int failed = 0;
    for (int64_t l = 0; l < s->layers && !failed; ++l) {
        const struct layer *t = layers + l;
        if (captures != NULL && captures[l] != NULL) store(captures[l], x, T * hidden, bf16);
        for (int64_t r = 0; r < T; ++r) rms_norm(x + r * hidden, t->input_norm, h + r * hidden, hidden, s->eps, bf16);
        failed |= project(&t->qkv, h, t->qkv_bias, wide, T, qkv_size, hidden, threads, bf16);
        for (int64_t r = 0; r < T; ++r)
            place_row(s, t, wide + r * qkv_size, step->positions[r], cos_table, sin_table, q + r * q_size,
                      (char *)new_k + element * (size_t)(r * kv_size), (char *)new_v + element * (size_t)(r * kv_size));
        failed |= paged_attention(q, t->k_cache, t->v_cache, step->tables, step->seq_lens, step->starts, NULL, attn,
                                  step->requests, s->heads, s->kv_heads, d, s->block_size, step->table_width, 0,
                                  s->scale, threads, new_k, new_v, step->slots, T, bf16);
        keep_all(attn, T * q_size, bf16);
        failed |= project(&t->o_proj, attn, NULL, h, T, hidden, q_size, threads, bf16);
        for (int64_t i = 0; i < T * hidden; ++i) x[i] = keep(x[i] + h[i], bf16);
        failed |= swiglu_mlp(x, h, wide, t->post_norm, &t->gate_up, &t->down, T, hidden, inter, s->eps, threads, bf16);
    }
    free(h);
    return failed;
}

/* The statement after it for each i in [0, n): on `threads` threads from PARALLEL_ROWS on (rows of a long step),
 * else a plain loop (an OpenMP region costs ~170 ns even when its `if` keeps it to one thread). Each i is computed
 * as alone, so either way gives the same bits. */
#define PARALLEL_ROWS 64
#define SPREAD(i, n, threads, STATEMENT)                                                                   \
    do {                                                                                                   \
        if ((n) >= PARALLEL_ROWS) {                                                                        \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
            for (int64_t i = 0; i < (n); ++i) STATEMENT;                                                   \
        } else                                                                                             \
            for (int64_t i = 0; i < (n); ++i) STATEMENT;                                                   \
    } while (0)

/* RMSNorm of one float32 row into a model-dtype row (rms_norm's arithmetic). */
static inline void norm_row(const float *x, const float *weight, void *out, int64_t n, float eps, int bf16) {
    float normed[n];
    rms_norm(x, weight, normed, n, eps, bf16);
    store(out, normed, n, bf16);
}

/* x [n] += a model-dtype row, kept as the torch layers keep it. */
static inline void add_row(float *x, const void *y, int64_t n, int bf16) {
    float added[n];
    load(added, y, n, bf16);
    for (int64_t i = 0; i < n; ++i) x[i] = keep(x[i] + added[i], bf16);
}

/* silu(gate) · up of one model-dtype row of gate_up's output gu [2 · inter] into act [inter] (model dtype). */
static inline void silu_row(const void *gu, void *act, int64_t inter, int bf16) {
    float row[2 * inter];
    load(row, gu, 2 * inter, bf16);
    float *gate = row;
    const float *up = row + inter;
#pragma GCC ivdep
    for (int64_t i = 0; i < inter; ++i) gate[i] = keep(keep(silu(gate[i]), bf16) * up[i], bf16);
    store(act, row, inter, bf16);
}

/* place_row for row r of the qkv projection's output (model dtype [rows, q_size + 2 · kv_size]): q to q_row
 * (float32), or when that is NULL to row r of q_out (model dtype); k and v to row r of new_k, new_v. */
static void place_output_row(const struct shape *s, const struct layer *t, const void *qkv, int64_t r,
                             int64_t position, const float *cos_table, const float *sin_table, float *q_row,
                             void *q_out, void *new_k, void *new_v) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim, width = q_size + 2 * kv_size;
    const size_t element = s->bf16 ? sizeof(uint16_t) : sizeof(float);
    float row[width], q_own[q_size];
    load(row, (const char *)qkv + element * (size_t)(r * width), width, s->bf16);
    place_row(s, t, row, position, cos_table, sin_table, q_row ? q_row : q_own,
              (char *)new_k + element * (size_t)(r * kv_size), (char *)new_v + element * (size_t)(r * kv_size));
    if (q_row == NULL) store((char *)q_out + element * (size_t)(r * q_size), q_own, q_size, s->bf16);
}

/* The bytes of workspace layers_through_caller needs for `tokens` rows (decode_step.py allocates and keeps it, so
 * a long step does not fault in fresh pages): x and, unless the caller attends, q and attn (float32) and the new
 * keys and values; the projections' input rows (model dtype). */
int64_t decode_step_workspace(const struct shape *s, int64_t tokens, int caller_attends) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    int64_t widest_input = s->hidden > q_size ? s->hidden : q_size; /* normed rows, attention, activations */
    if (s->intermediate > widest_input) widest_input = s->intermediate;
    const int64_t floats = tokens * (s->hidden + (caller_attends ? 0 : 2 * q_size + 2 * kv_size) + widest_input);
    return (int64_t)sizeof(float) * floats;
}

/* The layers with the caller's projections (and attention when step->attention is set): steps of more rows than
 * the kernels take, whose projections are GEMMs (oneDNN's in the caller) and whose prompt chunks may be longer
 * than paged_attention takes. The loops between the calls run on every thread from PARALLEL_ROWS rows, and read
 * and write the calls' rows in the model dtype where they lie (no float32 copies of a projection's rows). They are
 * compiled for 16-float vectors (GCC picks 8-float ones for this CPU, which the one-row GEMV prefers): a 128-token
 * bf16 SmolLM2 prompt's first token 44.7-45.2 -> 41.6-42.5 ms on the Xeon. */
__attribute__((target("prefer-vector-width=512")))
static int layers_through_caller(const struct shape *s, const struct layer *layers, const struct step *step, float *x,
                                 void *const *captures, const float *cos_table, const float *sin_table, int threads) {
    const int bf16 = s->bf16;
    const int64_t T = step->tokens, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t hidden = s->hidden, inter = s->intermediate;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    const struct caller *gemm = step->projection, *attention = step->attention;
    float *q = NULL, *attn = NULL;
    void *new_k = NULL, *new_v = NULL, *input = x + T * hidden;
    if (attention == NULL) {
        q = (float *)input, attn = q + T * q_size, new_k = attn + T * q_size;
        new_v = (char *)new_k + element * (size_t)(T * kv_size);
        input = (float *)new_k + 2 * T * kv_size;
    } else
        new_k = attention->k, new_v = attention->v;
    int failed = 0;
    for (int64_t l = 0; l < s->layers && !failed; ++l) {
        const struct layer *t = layers + l;
        if (captures != NULL && captures[l] != NULL) store(captures[l], x, T * hidden, bf16);
        SPREAD(r, T, threads, norm_row(x + r * hidden, t->input_norm, (char *)input + element * (size_t)(r * hidden),
                                       hidden, s->eps, bf16));
        if ((failed = gemm->call(4 * l, T, input))) break;
        const void *qkv = gemm->out;
        SPREAD(r, T, threads, place_output_row(s, t, qkv, r, step->positions[r], cos_table, sin_table,
                                               attention ? NULL : q + r * q_size, attention ? attention->q : NULL,
                                               new_k, new_v));
        const void *attended = input;
        if (attention != NULL) {
            if ((failed = attention->call(l, T, NULL))) break;
            attended = attention->out;
        } else {
            failed |= paged_attention(q, t->k_cache, t->v_cache, step->tables, step->seq_lens, step->starts, NULL,
                                      attn, step->requests, s->heads, s->kv_heads, d, s->block_size,
                                      step->table_width, 0, s->scale, threads, new_k, new_v, step->slots, T, bf16);
            SPREAD(r, T, threads, store((char *)input + element * (size_t)(r * q_size), attn + r * q_size, q_size, bf16));
        }
        if (failed || (failed = gemm->call(4 * l + 1, T, attended))) break;
        const void *o = gemm->out;
        SPREAD(r, T, threads, add_row(x + r * hidden, (const char *)o + element * (size_t)(r * hidden), hidden, bf16));
        SPREAD(r, T, threads, norm_row(x + r * hidden, t->post_norm, (char *)input + element * (size_t)(r * hidden),
                                       hidden, s->eps, bf16));
        if ((failed = gemm->call(4 * l + 2, T, input))) break;
        const void *gu = gemm->out;
        SPREAD(r, T, threads, silu_row((const char *)gu + element * (size_t)(r * 2 * inter),
                                       (char *)input + element * (size_t)(r * inter), inter, bf16));
        if ((failed = gemm->call(4 * l + 3, T, input))) break;
        const void *down = gemm->out;
        SPREAD(r, T, threads, add_row(x + r * hidden, (const char *)down + element * (size_t)(r * hidden), hidden, bf16));
    }
    return failed;
}

int decode_step(const struct shape *s, const struct layer *layers, const struct step *step, const void *x_in,
                void *x_out, const float *final_norm, const float *cos_table, const float *sin_table,
                void *const *captures, int threads) {
    const int bf16 = s->bf16;
    const int64_t T = step->tokens, hidden = s->hidden;
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    float *x = step->projection != NULL ? step->workspace : malloc(sizeof(float) * (size_t)(T * hidden));
    if (x == NULL) return 1;
    SPREAD(r, T, threads, load(x + r * hidden, (const char *)x_in + element * (size_t)(r * hidden), hidden, bf16));
    int failed = (step->projection != NULL ? layers_through_caller : layers_through_kernels)(
        s, layers, step, x, captures, cos_table, sin_table, threads);
    if (!failed) {
        if (captures != NULL && captures[s->layers] != NULL) store(captures[s->layers], x, T * hidden, bf16);
        SPREAD(r, T, threads, norm_row(x + r * hidden, final_norm, (char *)x_out + element * (size_t)(r * hidden),
                                       hidden, s->eps, bf16));
    }
    if (step->projection == NULL) free(x);
    return failed;
}
