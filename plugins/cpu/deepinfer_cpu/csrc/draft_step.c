/* A block drafter's two passes on the CPU, each in one call (deepinfer_cpu/draft_step.py loads it through ctypes;
 * linked with gemv.c and quant_linear.c, whose kernels it calls). What they compute is the core's
 * interfaces.BlockDrafterStack (the spec_decode plugin's dspark network):
 *
 * draft_context: each committed row's target features f become the context row c = RMSNorm(main_proj f), and each
 * layer's keys and values of it (ctx_kv c; the key's heads roped at the row's position) are stored in the cache
 * [slots, layers, 2, hidden] at the row's slot.
 *
 * draft_block: B requests' blocks of k embedded rows (the caller embeds them) at positions p … p + k − 1 pass the
 * layers: x += o · attention(rope(q), [window keys, rope(block keys)], [window values, block values]) with
 * q, k, v = qkv · RMSNorm(x), every block row seeing the request's visible window rows and all k block rows (no
 * causal mask); x += down · (silu(gate) · up)(gate_up · RMSNorm(x)). Then the logits of the final RMSNorm's rows
 * over the draft vocabulary (head), and in order of the block's rows the Markov correction: row i's logits plus
 * markov_head(markov_embed[previous]), previous the golden token (as a draft id) for i = 0 and draft i − 1 after;
 * the greedy draft is their argmax (the first of equal maxima, as torch's); its confidence sigmoid(clamp(z / T_i,
 * ±60)) with z = confidence · [x_i, markov_embed[previous]] + bias, x_i the row before the final norm. Drafts are
 * returned as target ids (d2t).
 *
 * The rope is the halves layout [x1 cos − x2 sin, x2 cos + x1 sin] over the angles position · inv_freq, with cos
 * and sin rounded to the model dtype first, as the torch layers compute it; every other value is rounded where
 * they round it (stack_ops.h), so the two differ in summation orders (the attention's and the GEMMs'), in the last
 * bits of cos, sin and exp, and so now and then in a near-tied draft. Each call returns 0, or 1 when a buffer
 * could not be allocated (here or in a kernel). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stack_ops.h"

#define LOGIT_CLAMP 60.0f

/* draft_step.py's _DraftLayer and _DraftNet fill the same fields, in this order. */
struct draft_layer {
    const float *attn_norm, *mlp_norm;
    struct projection qkv, ctx_kv, o, gate_up, down;
};

struct draft_net {
    int64_t layers, hidden, heads, intermediate, features, draft_vocab, rank;
    float eps, confidence_bias;
    int32_t bf16;
    const struct draft_layer *layer;
    struct projection main_proj, head, markov_head;
    const float *main_norm, *norm, *inv_freq;                /* inv_freq [head_dim / 2] */
    const void *markov_embed;                                 /* [draft_vocab (+ 1), rank], the model dtype */
    const float *confidence_weight, *confidence_temperature; /* [hidden + rank], [k] */
    const int64_t *d2t, *t2d;                                 /* draft → target ids and back; NULL: the same */
};

/* `heads` vectors of dim d roped in place at position pos (the halves layout of the file's comment). */
static void rope_halves(float *x, int64_t heads, int64_t d, int64_t pos, const float *inv_freq, int bf16) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float angle = (float)pos * inv_freq[i];
        const float c = keep(cosf(angle), bf16), s = keep(sinf(angle), bf16);
        for (float *v = x; v < x + heads * d; v += d) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = keep(keep(x1 * c, bf16) - keep(x2 * s, bf16), bf16);
            v[i + half] = keep(keep(x2 * c, bf16) + keep(x1 * s, bf16), bf16);
        }
    }
}

/* a · b in 16 independent partial sums (one SIMD register: a sum in order would run at the adds' latency), folded
 * in order, then the n % 16 tail. */
static float dot(const float *a, const float *b, int64_t n) {
    float partial[16] = {0.0f}, sum = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) partial[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 16; ++j) sum += partial[j];
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* Where element `at` of layer l's key (kv 0) or value (kv 1) of a slot lies in the cache [slots, layers, 2,
 * hidden]. */
static void *cache_at(const struct draft_net *n, const void *cache, int64_t slot, int64_t l, int64_t kv, int64_t at) {
    const size_t element = n->bf16 ? sizeof(uint16_t) : sizeof(float);
    return (char *)cache + element * (size_t)(((slot * n->layers + l) * 2 + kv) * n->hidden + at);
}

/* One request's k block rows over its window in layer l: qkv [k, 3 · hidden] (the rows' roped q and k, and v),
 * the window's slots [W] and which are visible; out [k, hidden]. scores: room for W + k floats; row: head_dim. */
static void attend(const struct draft_net *n, int64_t l, const float *qkv, const void *cache, const int64_t *slots,
                   const uint8_t *visible, int64_t W, int64_t k, float *out, float *scores, float *row) {
    const int bf16 = n->bf16;
    const int64_t H = n->hidden, d = H / n->heads;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t head = 0; head < n->heads; ++head)
        for (int64_t i = 0; i < k; ++i) {
            const float *q = qkv + i * 3 * H + head * d;
            float top = -INFINITY, total = 0.0f, *o = out + i * H + head * d;
            for (int64_t j = 0; j < W + k; ++j) {
                float s = -INFINITY;
                if (j >= W) {
                    s = dot(q, qkv + (j - W) * 3 * H + H + head * d, d) * scale;
                } else if (visible[j]) {
                    load(row, cache_at(n, cache, slots[j], l, 0, head * d), d, bf16);
                    s = dot(q, row, d) * scale;
                }
                scores[j] = s;
                top = s > top ? s : top;
            }
            for (int64_t j = 0; j < W + k; ++j) {
                scores[j] = exp_nonpositive(scores[j] - top);
                total += scores[j];
            }
            memset(o, 0, sizeof(float) * (size_t)d);
            for (int64_t j = 0; j < W + k; ++j) {
                if (scores[j] == 0.0f) continue;
                const float *v = row;
                if (j >= W)
                    v = qkv + (j - W) * 3 * H + 2 * H + head * d;
                else
                    load(row, cache_at(n, cache, slots[j], l, 1, head * d), d, bf16);
                const float p = scores[j] / total;
                for (int64_t e = 0; e < d; ++e) o[e] += p * v[e];
            }
        }
}

int draft_context(const struct draft_net *n, int64_t rows, const void *features, const int64_t *positions,
                  const int64_t *slots, void *cache, int threads) {
    const int bf16 = n->bf16;
    const int64_t H = n->hidden, F = n->features, d = H / n->heads;
    float *f = malloc(sizeof(float) * (size_t)(rows * (F + 3 * H)));
    if (f == NULL) return 1;
    float *c = f + rows * F, *kv = c + rows * H;
    load(f, features, rows * F, bf16);
    int failed = project(&n->main_proj, f, NULL, c, rows, H, F, threads, bf16);
    for (int64_t r = 0; r < rows; ++r) rms_norm(c + r * H, n->main_norm, c + r * H, H, n->eps, bf16);
    for (int64_t l = 0; l < n->layers && !failed; ++l) {
        failed |= project(&n->layer[l].ctx_kv, c, NULL, kv, rows, 2 * H, H, threads, bf16);
        for (int64_t r = 0; r < rows && !failed; ++r) {
            rope_halves(kv + r * 2 * H, n->heads, d, positions[r], n->inv_freq, bf16);
            store(cache_at(n, cache, slots[r], l, 0, 0), kv + r * 2 * H, 2 * H, bf16);
        }
    }
    free(f);
    return failed;
}

int draft_block(const struct draft_net *n, int64_t batch, int64_t k, int64_t W, const void *cache,
                const int64_t *slots, const uint8_t *visible, const void *embedded, const int64_t *last_tokens,
                const int64_t *positions, int64_t *tokens, float *confidence, int threads) {
    const int bf16 = n->bf16;
    const int64_t T = batch * k, H = n->hidden, I = n->intermediate, d = H / n->heads, V = n->draft_vocab;
    const int64_t R = n->rank, wide = 3 * H > 2 * I ? 3 * H : 2 * I;
    /* x (the residual), h, wide (qkv or gate/up), logits, Markov logits [batch, V], embeddings [T, R] and the
     * previous tokens' rows [batch, R], attention scores and one window row */
    float *x = malloc(sizeof(float) * (size_t)(T * (2 * H + wide + V + R) + batch * (V + R) + W + k + d));
    int64_t *previous = malloc(sizeof(int64_t) * (size_t)batch);
    if (x == NULL || previous == NULL) {
        free(x);
        free(previous);
        return 1;
    }
    float *h = x + T * H, *w = h + T * H, *logits = w + T * wide, *emb = logits + T * V;
    float *markov = emb + T * R, *rows = markov + batch * V, *scores = rows + batch * R, *row = scores + W + k;
    load(x, embedded, T * H, bf16);
    int failed = 0;
    for (int64_t l = 0; l < n->layers && !failed; ++l) {
        const struct draft_layer *t = n->layer + l;
        for (int64_t r = 0; r < T; ++r) rms_norm(x + r * H, t->attn_norm, h + r * H, H, n->eps, bf16);
        failed |= project(&t->qkv, h, NULL, w, T, 3 * H, H, threads, bf16);
        for (int64_t r = 0; r < T; ++r) /* q's and k's heads: 2 · heads vectors side by side */
            rope_halves(w + r * 3 * H, 2 * n->heads, d, positions[r / k] + r % k, n->inv_freq, bf16);
        for (int64_t b = 0; b < batch; ++b)
            attend(n, l, w + b * k * 3 * H, cache, slots + b * W, visible + b * W, W, k, h + b * k * H, scores, row);
        keep_all(h, T * H, bf16);
        failed |= project(&t->o, h, NULL, w, T, H, H, threads, bf16);
        for (int64_t i = 0; i < T * H; ++i) x[i] = keep(x[i] + w[i], bf16);
        failed |= swiglu_mlp(x, h, w, t->mlp_norm, &t->gate_up, &t->down, T, H, I, n->eps, threads, bf16);
    }
    for (int64_t r = 0; r < T; ++r) rms_norm(x + r * H, n->norm, h + r * H, H, n->eps, bf16);
    failed |= project(&n->head, h, NULL, logits, T, V, H, threads, bf16);
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t b = 0; b < batch; ++b) previous[b] = n->t2d ? n->t2d[last_tokens[b]] : last_tokens[b];
    for (int64_t i = 0; i < k && !failed; ++i) { /* in order: row i's correction reads draft i − 1 */
        for (int64_t b = 0; b < batch; ++b) {
            load(rows + b * R, (const char *)n->markov_embed + element * (size_t)(previous[b] * R), R, bf16);
            memcpy(emb + (b * k + i) * R, rows + b * R, sizeof(float) * (size_t)R);
        }
        failed |= project(&n->markov_head, rows, NULL, markov, batch, V, R, threads, bf16);
        for (int64_t b = 0; b < batch; ++b) {
            const float *lg = logits + (b * k + i) * V, *mk = markov + b * V;
            int64_t best = 0;
            float top = lg[0] + mk[0];
            for (int64_t v = 1; v < V; ++v)
                if (lg[v] + mk[v] > top) top = lg[v] + mk[v], best = v;
            previous[b] = best;
            tokens[b * k + i] = n->d2t ? n->d2t[best] : best;
            const int64_t r = b * k + i;
            const float z = keep(dot(n->confidence_weight, x + r * H, H) +
                                     dot(n->confidence_weight + H, emb + r * R, R) + n->confidence_bias, bf16);
            float u = z / n->confidence_temperature[i];
            u = u > LOGIT_CLAMP ? LOGIT_CLAMP : (u < -LOGIT_CLAMP ? -LOGIT_CLAMP : u);
            confidence[r] = 1.0f / (1.0f + expf(-u));
        }
    }
    free(x);
    free(previous);
    return failed;
}
