/* Paged decode attention on the CPU, float32 (deepinfer_cpu/paged_attention.py loads it through ctypes).
 *
 * One query token per request. Each (request, KV head) task reads that head's keys and values straight
 * from the paged cache through the request's block table, once, for all the query heads of its GQA
 * group: scores, softmax, weighted sum of values. Nothing is gathered into a temporary first.
 *
 * Layouts (all contiguous): q and out [batch, heads, dim]; k_cache and v_cache [blocks, block_size,
 * kv_heads, dim]; tables [batch, table_width] (block ids); seq_lens [batch] (keys of each request, its
 * query being the last); floors [batch] or NULL. Visible keys of a query at position p = len - 1:
 * j <= p; with window > 0 also j > p - window and (j >= floor or j == p), the core's rule
 * (deepinfer/model/layers/reference.py, _visible).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                     const int64_t *seq_lens, const int64_t *floors, float *out, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width, int64_t window,
                     float scale, int threads) {
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < batch * kv_heads; ++task) {
        const int64_t b = task / kv_heads, h = task % kv_heads;
        const int64_t len = seq_lens[b], p = len - 1;
        const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
        const int64_t floor_ = (window > 0 && floors != NULL) ? floors[b] : 0;
        const int64_t n = len - lo;
        const int64_t *table = tables + b * table_width;
        const float *qb = q + (b * heads + h * group) * dim;
        float *ob = out + (b * heads + h * group) * dim;
        float *scores = malloc(sizeof(float) * (size_t)(group * n));  /* [group][n]: one row per query head */
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const int64_t row = kv_heads * dim;  /* one cache position: every KV head's vector */
        /* Scores, block by block (one table lookup per block). */
        for (int64_t blk = lo / block_size; blk * block_size < len; ++blk) {
            const int64_t first = blk * block_size > lo ? blk * block_size : lo;
            const int64_t last = (blk + 1) * block_size < len ? (blk + 1) * block_size : len;
            const float *kj = k_cache + (table[blk] * block_size + (first - blk * block_size)) * row + h * dim;
            for (int64_t j = first; j < last; ++j, kj += row) {
                const int hidden = j < floor_ && j != p;
                for (int64_t g = 0; g < group; ++g) {
                    const float *qg = qb + g * dim;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < dim; ++d) acc += qg[d] * kj[d];
                    scores[g * n + (j - lo)] = hidden ? -INFINITY : acc * scale;
                }
            }
        }
        /* Softmax weights per query head (the key at p is always visible: the max is finite). */
        float sums[group];
        for (int64_t g = 0; g < group; ++g) {
            float *s = scores + g * n, top = -INFINITY, total = 0.0f;
            for (int64_t i = 0; i < n; ++i) top = s[i] > top ? s[i] : top;
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < n; ++i) {
                s[i] = expf(s[i] - top);
                total += s[i];
            }
            sums[g] = total;
        }
        /* Weighted sum of the values, block by block. */
        memset(ob, 0, sizeof(float) * (size_t)(group * dim));
        for (int64_t blk = lo / block_size; blk * block_size < len; ++blk) {
            const int64_t first = blk * block_size > lo ? blk * block_size : lo;
            const int64_t last = (blk + 1) * block_size < len ? (blk + 1) * block_size : len;
            const float *vj = v_cache + (table[blk] * block_size + (first - blk * block_size)) * row + h * dim;
            for (int64_t j = first; j < last; ++j, vj += row) {
                for (int64_t g = 0; g < group; ++g) {
                    const float w = scores[g * n + (j - lo)];
                    float *og = ob + g * dim;
#pragma omp simd
                    for (int64_t d = 0; d < dim; ++d) og[d] += w * vj[d];
                }
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            const float inv = 1.0f / sums[g];
            float *og = ob + g * dim;
            for (int64_t d = 0; d < dim; ++d) og[d] *= inv;
        }
        free(scores);
    }
    return failed;
}
