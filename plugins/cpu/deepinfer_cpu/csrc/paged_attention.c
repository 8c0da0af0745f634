/* Paged attention for short query rows on the CPU (deepinfer_cpu/paged_attention.py loads it through
 * ctypes): decode rows, speculative verification rows, short prompt chunks. Queries, outputs and all sums
 * are float32; the cache (and the step's new keys and values) holds float32 or, with bf16 set, bfloat16
 * elements (converted exactly to float32 where they are read).
 *
 * Request r owns query rows [starts[r], starts[r + 1]): its last m tokens, at positions len - m .. len - 1
 * (len = seq_lens[r], their keys already written to the cache). Each (request, KV head) task reads that
 * head's keys and values straight from the paged cache through the request's block table, once, for every
 * query row of the request and every query head of the KV head's GQA group: scores, softmax, weighted sum
 * of values. Nothing is gathered into a temporary first. With AVX-512 and heads of up to 128 (a multiple of
 * 16) each key and value is widened into registers once for all those rows and heads (on the 2-core Xeon a
 * 6-row verification step's attention over 300 keys ran 1.7x faster than widening it for every row and head).
 * Heads of 64 or 128 floats go through register passes (QK_REGISTERS, PV_REGISTERS) of up to 6 (3) score rows:
 * queries and output sums stay in registers across the keys, with the same arithmetic in the same order (the
 * same bits); a batch-18 decode step over ~520 keys went from 0.61 to 0.44 ms a layer on the Xeon.
 * On a CPU with AMX-BF16 a bf16 cache's scores go through the tile unit instead (tile_scores; no window, heads of
 * 64 or 128, blocks of a multiple of 16 keys): 16 keys a tile where they lie in the cache against up to 16 score
 * rows' queries rounded to bf16 (exact for a bf16 model, whose queries are bf16 values), with no per-key
 * reduction; the weighted sum of the values stays in the register passes (float32 weights). A decode step of 18
 * requests over ~520 keys: 0.36 -> 0.25 ms a layer on the Xeon, verification rows 1.3-1.4x faster. Which path
 * scores a call depends only on the cache's dtype and shape, never on the rows, and each score is one tile element:
 * rows alone or together still agree bit for bit. A prompt chunk (a request of more than CHUNK_ROWS rows, in tasks
 * of CHUNK_ROWS) multiplies its values through the tiles too: its weights rounded to bf16 (as SDPA's flash kernel
 * rounds them) the A tiles, the values in pairs of keys the B tiles; a 128-row bf16 prompt's attention 0.28 -> 0.17
 * ms a SmolLM2 layer. Requests of up to CHUNK_ROWS rows (decode, verification) keep the float32 value passes.
 * When a call has fewer (request, KV head) pairs than two per thread, a request's rows are split into chunks,
 * one task each, so the threads share the work (a 6-row step of SmolLM2's 3 KV heads on 2 threads). With
 * requests enough, a thread takes all the tasks of a request at once: its KV heads share the cache's blocks (one
 * cache position holds every head's vector), and one thread reading all of them was ~15% faster than the heads
 * spread over the threads.
 *
 * Layouts (all contiguous): q and out [tokens, heads, dim]; k_cache and v_cache [blocks, block_size,
 * kv_heads, dim]; tables [requests, table_width] (block ids); seq_lens [requests]; starts [requests + 1];
 * floors [requests] or NULL. When new_k is not NULL, the step's own keys and values (new_k, new_v [new_tokens,
 * kv_heads, dim], contiguous) are first stored at their flat cache slots (slots [new_tokens]), so a decode step
 * writes its cache and attends in one call (the core's write_kv is two index_copy_ calls per layer). Visible
 * keys of a query at position p: j <= p; with window > 0 also
 * j > p - window and (j >= floor or j == p), the core's rule (deepinfer/model/layers/reference.py, _visible).
 * Returns 0, or 1 when a score buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fastexp.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* q . k over dim, k float32 or bfloat16: 16-lane partial sums, then a tree (an OpenMP simd reduction over
 * one short vector ends in 16 dependent scalar additions per dot, most of a decode step's attention time). */
static inline float dot(const float *a, const void *b, int64_t dim, int bf16) {
#ifdef __AVX512F__
    if (dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + d));
            const __m512 kb = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
                                   : _mm512_loadu_ps((const float *)b + d);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), kb, acc);
        }
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc = 0.0f;
    if (bf16) {
        const uint16_t *k = b;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; ++d) acc += a[d] * bf16_to_float(k[d]);
    } else {
        const float *k = b;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < dim; ++d) acc += a[d] * k[d];
    }
    return acc;
}

/* out += w v over dim, v float32 or bfloat16. */
static inline void add_scaled(float *out, float w, const void *v, int64_t dim, int bf16) {
    if (bf16) {
        const uint16_t *x = v;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += w * bf16_to_float(x[d]);
    } else {
        const float *x = v;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[d] += w * x[d];
    }
}

#ifdef __AVX512F__
#define MAX_VECTORS 8 /* the register path's widest head: 128 floats */

/* A key's or value's vector as float32 registers (16 lanes each), from float32 or bfloat16 (exactly). */
static inline void load_row(__m512 *dst, const void *src, int64_t vectors, int bf16) {
    for (int64_t v = 0; v < vectors; ++v) {
        if (!bf16) {
            dst[v] = _mm512_loadu_ps((const float *)src + 16 * v);
            continue;
        }
        const __m256i halves = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + 16 * v));
        dst[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    }
}
#endif

#define TILE_LANES 16 /* score rows per AMX tile: a QK tile's 16 columns, a PV tile's 16 rows */
/* The most query rows of one request a task takes (paged_attention.py's MAX_QUERY_ROWS): a verification step's
 * 1 + drafts in one task; with tiles, a longer prompt chunk's rows in tasks of this many. */
#define CHUNK_ROWS 16

static int visible(int64_t j, int64_t p, int64_t window, int64_t floor_) {
    if (j > p) return 0;
    if (window > 0 && (j <= p - window || (j < floor_ && j != p))) return 0;
    return 1;
}

/* The keys [*begin, *end) of table block blk that lie in [lo, len), and the offset in a cache tensor of key
 * *begin's vector for KV head h. */
static int64_t block_span(const int64_t *table, int64_t blk, int64_t lo, int64_t len, int64_t block_size,
                          int64_t row, int64_t h, int64_t dim, int64_t *begin, int64_t *end) {
    *begin = blk * block_size > lo ? blk * block_size : lo;
    *end = (blk + 1) * block_size < len ? (blk + 1) * block_size : len;
    return (table[blk] * block_size + (*begin - blk * block_size)) * row + h * dim;
}

/* Head h's rows of cache block `block` asked for while the block before is computed: a task's blocks lie anywhere
 * in the pool, so the hardware prefetcher stops at each block's end (a batch-18 decode step over ~520 keys: 49
 * against 42 ms on the Xeon). */
static inline void prefetch_head_block(const char *cache, int64_t block, int64_t block_size, int64_t row, int64_t h,
                                       int64_t dim, size_t element) {
    const char *first = cache + (block * block_size * row + h * dim) * (int64_t)element;
    for (int64_t t = 0; t < block_size; ++t)
        for (int64_t b = 0; b < dim * (int64_t)element; b += 64)
            __builtin_prefetch(first + t * row * (int64_t)element + b);
}

/* Key `*j`'s vector of head h in `cache`, for the first key of table block blk that lies in [lo, len) (*j and
 * *end: that block's keys there); the next block's rows asked for meanwhile (prefetch_head_block). */
static inline const char *block_start(const char *cache, const int64_t *table, int64_t blk, int64_t lo, int64_t len,
                                      int64_t block_size, int64_t row, int64_t h, int64_t dim, size_t element,
                                      int64_t *j, int64_t *end) {
    if ((blk + 1) * block_size < len) prefetch_head_block(cache, table[blk + 1], block_size, row, h, dim, element);
    return cache + block_span(table, blk, lo, len, block_size, row, h, dim, j, end) * element;
}

/* The statement after it, once for every key j in [lo, len) of head h with `at` pointing at its vector in `cache`,
 * block by block (one table lookup per block). */
#define FOR_EACH_KEY(cache, at)                                                                                \
    for (int64_t blk = lo / block_size, j = 0, end = 0; blk * block_size < len; ++blk)                          \
        for (const char *at = block_start(cache, table, blk, lo, len, block_size, row, h, dim, element, &j, &end); \
             j < end; ++j, at += row * element)

#ifdef __AVX512F__
/* The weighted sum of the values for LANES score rows of VECTORS vectors each (a head of 16 * VECTORS floats),
 * the sums held in registers across every key (storing them to out and loading them back for each key made a
 * chain through memory: a batch-18 decode step's attention over ~520 keys took 0.6 ms a layer). The same fused
 * multiply-adds in the same key order as the memory path, so the same bits. lane_out[l] is lane l's output row. */
#define PV_REGISTERS(NAME, VECTORS, LANES)                                                                     \
    static void NAME(const char *values, const int64_t *table, int64_t lo, int64_t len, int64_t block_size,    \
                     int64_t row, int64_t h, int64_t dim, size_t element, int bf16, const float *const *weights, \
                     float *const *lane_out) {                                                                  \
        __m512 acc[LANES][VECTORS];                                                                            \
        _Pragma("GCC unroll 8") for (int l = 0; l < (LANES); ++l)                                              \
            _Pragma("GCC unroll 8") for (int v = 0; v < (VECTORS); ++v) acc[l][v] = _mm512_setzero_ps();       \
        FOR_EACH_KEY(values, vj) {                                                                             \
            __m512 value[VECTORS];                                                                             \
            load_row(value, vj, VECTORS, bf16);                                                                \
            _Pragma("GCC unroll 8") for (int l = 0; l < (LANES); ++l) {                                        \
                const float w = weights[l][j - lo];                                                            \
                if (w == 0.0f) continue; /* masked (or vanishing) */                                           \
                const __m512 weight = _mm512_set1_ps(w);                                                       \
                _Pragma("GCC unroll 8") for (int v = 0; v < (VECTORS); ++v)                                    \
                    acc[l][v] = _mm512_fmadd_ps(weight, value[v], acc[l][v]);                                  \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 8") for (int l = 0; l < (LANES); ++l)                                              \
            _Pragma("GCC unroll 8") for (int v = 0; v < (VECTORS); ++v)                                        \
                _mm512_storeu_ps(lane_out[l] + 16 * v, acc[l][v]);                                             \
    }
/* Every (head width, score rows) pair a register pass serves: heads of 4 vectors (64 floats) by 1-6 rows, of 8
 * (128 floats) by 1-3 (24 accumulators at most); PASS(NAME, VECTORS, LANES) for each, and their table. */
#define EACH_PASS(PASS, P)                                                                                     \
    PASS(P##_4x1, 4, 1) PASS(P##_4x2, 4, 2) PASS(P##_4x3, 4, 3) PASS(P##_4x4, 4, 4) PASS(P##_4x5, 4, 5)        \
    PASS(P##_4x6, 4, 6) PASS(P##_8x1, 8, 1) PASS(P##_8x2, 8, 2) PASS(P##_8x3, 8, 3)
#define PASS_TABLE(P) {P##_4x1, P##_4x2, P##_4x3, P##_4x4, P##_4x5, P##_4x6, P##_8x1, P##_8x2, P##_8x3}

/* The score rows a register pass takes at once for heads of `vectors` vectors (0: no pass serves them), and its
 * place in a PASS_TABLE for `lanes` rows (at most that many). */
static int64_t lanes_per_pass(int64_t vectors) { return vectors == 4 ? 6 : vectors == 8 ? 3 : 0; }
static int pass_index(int64_t vectors, int64_t lanes) { return (vectors == 4 ? 0 : 6) + (int)lanes - 1; }

EACH_PASS(PV_REGISTERS, pv)
typedef void (*pv_pass)(const char *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, size_t,
                        int, const float *const *, float *const *);
static const pv_pass pv_passes[] = PASS_TABLE(pv);

/* The scores of LANES score rows (query vectors of VECTORS vectors, lane_q[l]) against every key in [lo, len), as
 * the key-by-key path computes them (the same fused multiply-adds and reduction: the same bits), with the queries
 * in registers and no visibility test per key: the caller masks the keys past each row's position after. */
#define QK_REGISTERS(NAME, VECTORS, LANES)                                                                     \
    static void NAME(const char *keys, const int64_t *table, int64_t lo, int64_t len, int64_t block_size,      \
                     int64_t row, int64_t h, int64_t dim, size_t element, int bf16, const float *const *lane_q, \
                     float scale, float *const *lane_scores) {                                                  \
        __m512 query[LANES][VECTORS];                                                                          \
        _Pragma("GCC unroll 8") for (int l = 0; l < (LANES); ++l)                                              \
            _Pragma("GCC unroll 8") for (int v = 0; v < (VECTORS); ++v)                                        \
                query[l][v] = _mm512_loadu_ps(lane_q[l] + 16 * v);                                             \
        FOR_EACH_KEY(keys, kj) {                                                                               \
            __m512 key[VECTORS];                                                                               \
            load_row(key, kj, VECTORS, bf16);                                                                  \
            _Pragma("GCC unroll 8") for (int l = 0; l < (LANES); ++l) {                                        \
                __m512 acc = _mm512_setzero_ps();                                                              \
                _Pragma("GCC unroll 8") for (int v = 0; v < (VECTORS); ++v)                                    \
                    acc = _mm512_fmadd_ps(query[l][v], key[v], acc);                                           \
                lane_scores[l][j - lo] = _mm512_reduce_add_ps(acc) * scale;                                    \
            }                                                                                                  \
        }                                                                                                      \
    }
EACH_PASS(QK_REGISTERS, qk)
typedef void (*qk_pass)(const char *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, size_t,
                        int, const float *const *, float, float *const *);
static const qk_pass qk_passes[] = PASS_TABLE(qk);
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h"

/* Whether the tile path serves a call: a bf16 cache, no window, heads of 64 or 128 floats, cache blocks of a
 * multiple of 16 keys (a tile's 16 keys lie in one block), and the tile state granted. */
static int tiles_attend(int bf16, int64_t window, int64_t dim, int64_t block_size) {
    return bf16 && window == 0 && (dim == 64 || dim == 128) && block_size % 16 == 0 && amx_permitted();
}

/* Every tile 16 rows of 64 bytes: 16 keys or lanes by 32 bf16, or 16 by 16 float32 sums. */
static void configure_tiles(void) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The lanes' queries (lane_q[l], l < lanes) rounded to bf16 as B tiles, 16 lanes a group (the last padded with
 * zero queries): group g's chunk kc of 32 dims at qv + (g · dim / 32 + kc) · 256 words (pack_pairs's layout).
 * A bf16 model's queries are bf16 values already: the rounding is exact there. */
static void pack_queries(const float *const *lane_q, int64_t lanes, int64_t dim, uint32_t *qv) {
    float rows[TILE_LANES * 128];
    for (int64_t g = 0; g * TILE_LANES < lanes; ++g) {
        for (int64_t i = 0; i < TILE_LANES; ++i) {
            const int64_t l = g * TILE_LANES + i;
            if (l < lanes) memcpy(rows + i * dim, lane_q[l], sizeof(float) * (size_t)dim);
            else memset(rows + i * dim, 0, sizeof(float) * (size_t)dim);
        }
        pack_pairs(rows, (uint16_t *)(qv + g * (dim / 32) * 256), TILE_LANES, dim);
    }
}

/* Scores (scaled) of the lanes against keys [0, len) of head h, 16 keys a tile: the keys the A tiles where they
 * lie in the cache (a row apart), the queries the B tiles (pack_queries); scores[l · n + j]. A last tile's keys
 * past len are multiplied from whatever their block holds there and not stored. Each score is one tile element:
 * its sum does not depend on the other lanes or keys. Tiles: A 0-3 (32 dims each), C 4, B 5. */
static void tile_scores(const char *keys, const int64_t *table, int64_t len, int64_t block_size, int64_t row,
                        int64_t h, int64_t dim, const uint32_t *qv, int64_t lanes, float scale, float *scores,
                        int64_t n) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512 scaled = _mm512_set1_ps(scale);
    const int64_t chunks = dim / 32, stride = row * (int64_t)sizeof(uint16_t);
    float c[16][16];
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t blk = j0 / block_size, at = j0 % block_size;
        if (at == 0 && (blk + 1) * block_size < len)
            prefetch_head_block(keys, table[blk + 1], block_size, row, h, dim, sizeof(uint16_t));
        const uint16_t *k = (const uint16_t *)keys + (table[blk] * block_size + at) * row + h * dim;
        _tile_loadd(0, k, stride);
        _tile_loadd(1, k + 32, stride);
        if (chunks == 4) {
            _tile_loadd(2, k + 64, stride);
            _tile_loadd(3, k + 96, stride);
        }
        const __mmask16 valid = len - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - j0)) - 1);
        for (int64_t g = 0; g * TILE_LANES < lanes; ++g) {
            const uint32_t *b = qv + g * chunks * 256;
            _tile_zero(4);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(4, 0, 5);
            _tile_loadd(5, b + 256, 64);
            _tile_dpbf16ps(4, 1, 5);
            if (chunks == 4) {
                _tile_loadd(5, b + 512, 64);
                _tile_dpbf16ps(4, 2, 5);
                _tile_loadd(5, b + 768, 64);
                _tile_dpbf16ps(4, 3, 5);
            }
            _tile_stored(4, c, 64);
            const int64_t count = lanes - g * TILE_LANES < TILE_LANES ? lanes - g * TILE_LANES : TILE_LANES;
            for (int64_t i = 0; i < count; ++i) /* column i of the tile: lane g · 16 + i's scores */
                _mm512_mask_storeu_ps(scores + (g * TILE_LANES + i) * n + j0, valid,
                                      _mm512_mul_ps(_mm512_i32gather_ps(column, &c[0][i], 4), scaled));
        }
    }
}

/* The values of keys [0, n32) of head h as B tiles: pairs of keys interleaved per column, vv + (chunk · dim / 16 +
 * slice) · 256 words for 32-key chunk `chunk` and 16-column slice `slice` (a row per key pair, a word per column:
 * the column's values at keys 2p and 2p + 1); keys from len on are zero (their weights are zero, but the cache
 * there may hold anything). */
static void pack_values(const char *values, const int64_t *table, int64_t len, int64_t n32, int64_t block_size,
                        int64_t row, int64_t h, int64_t dim, uint32_t *vv) {
    uint16_t low[32], high[32]; /* interleaving indices: columns 0-15, 16-31 */
    for (int i = 0; i < 16; ++i) {
        low[2 * i] = (uint16_t)i, low[2 * i + 1] = (uint16_t)(32 + i);
        high[2 * i] = (uint16_t)(16 + i), high[2 * i + 1] = (uint16_t)(48 + i);
    }
    const __m512i first = _mm512_loadu_si512(low), second = _mm512_loadu_si512(high);
    const int64_t slices = dim / 16;
    for (int64_t j = 0; j < n32; j += 2) {
        if (j % block_size == 0 && j + block_size < len)
            prefetch_head_block(values, table[j / block_size + 1], block_size, row, h, dim, sizeof(uint16_t));
        const uint16_t *a = j < len ? (const uint16_t *)values + (table[j / block_size] * block_size + j % block_size)
                                          * row + h * dim : NULL;
        const uint16_t *b = j + 1 < len ? a + row : NULL; /* keys j and j + 1 share a block (blocks are even) */
        uint32_t *to = vv + ((j / 32) * slices * 16 + (j % 32) / 2) * 16;
        for (int64_t z = 0; z < dim / 32; ++z) {
            const __m512i x = a ? _mm512_loadu_si512(a + 32 * z) : _mm512_setzero_si512();
            const __m512i y = b ? _mm512_loadu_si512(b + 32 * z) : _mm512_setzero_si512();
            _mm512_storeu_si512(to + (2 * z) * 256, _mm512_permutex2var_epi16(x, first, y));
            _mm512_storeu_si512(to + (2 * z + 1) * 256, _mm512_permutex2var_epi16(x, second, y));
        }
    }
}

/* lane_out[l] = the lanes' weighted sums of the values: the weights p (bf16 [lane groups · 16][n32], zero past
 * each lane's visible keys, padding lanes zero) the A tiles (16 lanes × 32 keys), the values the B tiles
 * (pack_values), four 16-column C tiles at once, keys in order: each output one tile element, its sum independent
 * of the other lanes. Tiles: C 0-3, A 4, B 5. */
static void tile_values(const uint16_t *p, int64_t n32, const uint32_t *vv, int64_t lanes, int64_t dim,
                        float *const *lane_out) {
    const int64_t slices = dim / 16;
    float c[4][16][16];
    for (int64_t g = 0; g * TILE_LANES < lanes; ++g) {
        const int64_t count = lanes - g * TILE_LANES < TILE_LANES ? lanes - g * TILE_LANES : TILE_LANES;
        for (int64_t s0 = 0; s0 < slices; s0 += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < n32 / 32; ++k) {
                const uint32_t *b = vv + (k * slices + s0) * 256;
                _tile_loadd(4, p + g * TILE_LANES * n32 + k * 32, n32 * (int64_t)sizeof(uint16_t));
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, b + 256, 64);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, b + 512, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, b + 768, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            for (int64_t i = 0; i < count; ++i)
                for (int t = 0; t < 4; ++t)
                    memcpy(lane_out[g * TILE_LANES + i] + (s0 + t) * 16, c[t][i], sizeof(float) * 16);
        }
    }
}
#endif

/* Whether a call on such a cache goes through the tiles (tiles_attend): paged_attention.py sends the kernel
 * prompt chunks of more than CHUNK_ROWS rows only then. */
int paged_attention_tiles(int bf16, int64_t window, int64_t dim, int64_t block_size) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return tiles_attend(bf16, window, dim, block_size);
#else
    (void)bf16, (void)window, (void)dim, (void)block_size;
    return 0;
#endif
}

/* Where score row `lane` (query row lane / group of the task, query head lane % group of KV head h's group) has
 * its query and output vectors in q and out. */
static inline int64_t lane_offset(int64_t lane, int64_t group, int64_t row0, int64_t heads, int64_t h, int64_t dim) {
    return ((row0 + lane / group) * heads + h * group + lane % group) * dim;
}

int paged_attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                    const int64_t *seq_lens, const int64_t *starts, const int64_t *floors, float *out,
                    int64_t requests, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                    int64_t table_width, int64_t window, float scale, int threads, const void *new_k,
                    const void *new_v, const int64_t *slots, int64_t new_tokens, int bf16) {
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * dim; /* one cache position: every KV head's vector */
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    const char *keys = k_cache, *values = v_cache;
#ifdef __AVX512F__
    const int64_t vectors = dim / 16;
    const int in_registers = dim % 16 == 0 && vectors <= MAX_VECTORS;
#endif
    int failed = 0;
    if (new_k != NULL) {
        for (int64_t t = 0; t < new_tokens; ++t) {
            const size_t to = (size_t)(slots[t] * row) * element, from = (size_t)(t * row) * element;
            memcpy((char *)k_cache + to, (const char *)new_k + from, element * (size_t)row);
            memcpy((char *)v_cache + to, (const char *)new_v + from, element * (size_t)row);
        }
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    const int tiles = tiles_attend(bf16, window, dim, block_size);
#else
    const int tiles = 0;
#endif
    /* A request's rows split into chunks, one task each: when there are fewer (request, KV head) pairs than two
     * per thread (a 6-row verification step's 3 SmolLM2 KV heads left one of 2 threads idle a third of the time),
     * and a prompt chunk of more than CHUNK_ROWS rows into tasks of at most that many. task_start[r]:
     * request r's first task (its chunks, KV head by KV head). */
    const int64_t pairs = requests * kv_heads;
    const int64_t least = pairs >= 2 * threads ? 1 : (2 * threads + pairs - 1) / pairs;
    int64_t *task_start = malloc(sizeof(int64_t) * (size_t)(2 * requests + 1));
    if (task_start == NULL) return 1;
    int64_t *chunks_of = task_start + requests + 1;
    int any_long = 0;
    task_start[0] = 0;
    for (int64_t r = 0; r < requests; ++r) {
        const int64_t all = starts[r + 1] - starts[r], by_size = (all + CHUNK_ROWS - 1) / CHUNK_ROWS;
        any_long |= all > CHUNK_ROWS;
        chunks_of[r] = by_size > least ? by_size : least;
        task_start[r + 1] = task_start[r] + kv_heads * chunks_of[r];
    }
    /* With requests enough, a thread takes all of a request's KV heads at once: they share its cache blocks (one
     * cache position holds every head's vector), and one thread reading all of them was ~15% faster. */
    const int64_t per_grab = requests >= 2 * threads && !any_long ? kv_heads * least : 1;
#pragma omp parallel num_threads(threads)
    {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (tiles) configure_tiles();
#endif
#pragma omp for schedule(dynamic, per_grab)
    for (int64_t task = 0; task < task_start[requests]; ++task) {
        int64_t r = 0; /* the request whose tasks hold `task`: a binary search over task_start */
        for (int64_t hi = requests; hi - r > 1;) {
            const int64_t mid = (r + hi) / 2;
            if (task_start[mid] <= task) r = mid;
            else hi = mid;
        }
        const int64_t chunks = chunks_of[r], h = (task - task_start[r]) / chunks, c = (task - task_start[r]) % chunks;
        const int64_t all = starts[r + 1] - starts[r], first_pos = seq_lens[r] - all;
        const int64_t i0 = c * all / chunks, m = (c + 1) * all / chunks - i0; /* this task's rows: i0 .. i0 + m - 1 */
        if (m == 0) continue;
        const int64_t len = first_pos + i0 + m, row0 = starts[r] + i0; /* keys past the last row's are masked */
        const int64_t lo = (window > 0 && first_pos - window + 1 > 0) ? first_pos - window + 1 : 0;
        const int64_t floor_ = (window > 0 && floors != NULL) ? floors[r] : 0;
        const int64_t n = len - lo, lanes = m * group; /* score rows: (query row, query head of the group) */
        const int64_t *table = tables + r * table_width;
        /* A prompt chunk's rows (more than CHUNK_ROWS in the request) multiply the values through the tiles too,
         * their weights rounded to bf16; a request of fewer rows (decode, verification) keeps float32 weights, so
         * its rows agree bit for bit alone or together. */
        const int long_chunk = tiles && all > CHUNK_ROWS;
        /* [lanes][n] scores, then the sums; with tiles the queries in the tiles' layout, and for a prompt chunk
         * the weights (bf16 [lane groups · 16][n32]) and the values (bf16 [n32][dim]) in theirs */
        const int64_t groups = (lanes + TILE_LANES - 1) / TILE_LANES, n32 = (n + 31) / 32 * 32;
        const int64_t query_words = tiles ? groups * (dim / 32) * 256 : 0;
        const int64_t tile_words = long_chunk ? groups * TILE_LANES * n32 / 2 + n32 * dim / 2 : 0;
        float *scores = malloc(sizeof(float) * (size_t)(lanes * n + lanes + query_words + tile_words));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float *sums = scores + lanes * n;
        /* a prompt chunk's weights as the value tiles take them (bf16, padding lanes and keys zero) */
        uint16_t *weights16 = long_chunk ? (uint16_t *)((uint32_t *)(sums + lanes) + query_words + n32 * dim / 2) : NULL;
        if (long_chunk) memset(weights16, 0, sizeof(uint16_t) * (size_t)(groups * TILE_LANES * n32));
        int64_t per_pass = 0; /* score rows per register pass (0: none serves this head width) */
#ifdef __AVX512F__
        per_pass = in_registers ? lanes_per_pass(vectors) : 0;
#endif
        const float *lane_q[lanes];
        float *lane_out[lanes];
        for (int64_t lane = 0; lane < lanes; ++lane) {
            lane_q[lane] = q + lane_offset(lane, group, row0, heads, h, dim);
            lane_out[lane] = out + lane_offset(lane, group, row0, heads, h, dim);
        }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (tiles) { /* the scores through the tiles over every key */
            uint32_t *qv = (uint32_t *)(sums + lanes);
            pack_queries(lane_q, lanes, dim, qv);
            tile_scores(keys, table, len, block_size, row, h, dim, qv, lanes, scale, scores, n);
        } else
#endif
#ifdef __AVX512F__
        /* Without a window, the scores in register passes over every key, then the keys past each row masked. */
        if (per_pass && window == 0) {
            for (int64_t first = 0; first < lanes; first += per_pass) {
                const int64_t count = lanes - first < per_pass ? lanes - first : per_pass;
                float *lane_scores[6];
                for (int64_t l = 0; l < count; ++l) lane_scores[l] = scores + (first + l) * n;
                qk_passes[pass_index(vectors, count)](keys, table, lo, len, block_size, row, h, dim, element, bf16,
                                                      lane_q + first, scale, lane_scores);
            }
        } else
#endif
        /* Scores, key by key with the visibility test. */
        FOR_EACH_KEY(keys, kj) {
#ifdef __AVX512F__
            if (in_registers) { /* the key widened once for every lane: the sums as dot()'s */
                __m512 key[MAX_VECTORS];
                load_row(key, kj, vectors, bf16);
                for (int64_t lane = 0; lane < lanes; ++lane) {
                    float score = -INFINITY;
                    if (visible(j, first_pos + i0 + lane / group, window, floor_)) {
                        __m512 acc = _mm512_setzero_ps();
                        for (int64_t v = 0; v < vectors; ++v)
                            acc = _mm512_fmadd_ps(_mm512_loadu_ps(lane_q[lane] + 16 * v), key[v], acc);
                        score = _mm512_reduce_add_ps(acc) * scale;
                    }
                    scores[lane * n + (j - lo)] = score;
                }
                continue;
            }
#endif
            for (int64_t lane = 0; lane < lanes; ++lane)
                scores[lane * n + (j - lo)] = visible(j, first_pos + i0 + lane / group, window, floor_)
                                                  ? dot(lane_q[lane], kj, dim, bf16) * scale : -INFINITY;
        }
        if (tiles || (per_pass && window == 0)) /* those paths scored every key: row i sees up to its position */
            for (int64_t lane = 0; lane < lanes; ++lane)
                for (int64_t j = first_pos + i0 + lane / group + 1; j < len; ++j) scores[lane * n + (j - lo)] = -INFINITY;
        /* Softmax weights per lane (a query's own key is always visible: the max is finite). The sum goes
         * into 16 partial sums by key position, then a fixed tree: a query's weights sum in the same order
         * whatever else the call holds (its masked keys add exact zeros), so a row's output does not depend on
         * the rows beside it — decode and verification agree bit for bit. */
        for (int64_t lane = 0; lane < lanes; ++lane) {
            float *s = scores + lane * n, top = -INFINITY, part[16] = {0.0f};
#pragma omp simd reduction(max : top) /* in vector lanes: a scalar chain of maxima was 40% of a prompt chunk's time */
            for (int64_t x = 0; x < n; ++x) top = s[x] > top ? s[x] : top;
#pragma omp simd
            for (int64_t x = 0; x < n; ++x) s[x] = exp_nonpositive(s[x] - top);
            if (long_chunk) { /* the weights the value tiles multiply: bf16 values, summed as they weigh */
                uint16_t *w = weights16 + lane * n32;
#pragma omp simd
                for (int64_t x = 0; x < n; ++x) {
                    w[x] = float_to_bf16(s[x]);
                    s[x] = bf16_to_float(w[x]);
                }
            }
            int64_t x = 0;
            for (; x < n && ((lo + x) & 15); ++x) part[(lo + x) & 15] += s[x];
            for (; x + 16 <= n; x += 16) { /* key positions aligned to 16: lane l takes position l mod 16 */
#pragma omp simd
                for (int l = 0; l < 16; ++l) part[l] += s[x + l];
            }
            for (; x < n; ++x) part[(lo + x) & 15] += s[x];
            for (int width = 8; width >= 1; width /= 2)
                for (int l = 0; l < width; ++l) part[l] += part[l + width];
            sums[lane] = part[0];
        }
        /* Weighted sum of the values: a prompt chunk's through the tiles; else block by block, in registers where a
         * pass serves the head's width. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (long_chunk) {
            uint32_t *vv = (uint32_t *)(sums + lanes) + query_words;
            pack_values(values, table, len, n32, block_size, row, h, dim, vv);
            tile_values(weights16, n32, vv, lanes, dim, lane_out);
        } else
#endif
#ifdef __AVX512F__
        if (per_pass) {
            for (int64_t first = 0; first < lanes; first += per_pass) {
                const int64_t count = lanes - first < per_pass ? lanes - first : per_pass;
                const float *weights[6];
                for (int64_t l = 0; l < count; ++l) weights[l] = scores + (first + l) * n;
                pv_passes[pass_index(vectors, count)](values, table, lo, len, block_size, row, h, dim, element, bf16,
                                                      weights, lane_out + first);
            }
        } else
#endif
        {
            for (int64_t lane = 0; lane < lanes; ++lane) memset(lane_out[lane], 0, sizeof(float) * (size_t)dim);
            FOR_EACH_KEY(values, vj) {
#ifdef __AVX512F__
                if (in_registers) { /* the value widened once for every lane */
                    __m512 value[MAX_VECTORS];
                    load_row(value, vj, vectors, bf16);
                    for (int64_t lane = 0; lane < lanes; ++lane) {
                        const float w = scores[lane * n + (j - lo)];
                        if (w == 0.0f) continue; /* masked (or vanishing) */
                        const __m512 weight = _mm512_set1_ps(w);
                        for (int64_t v = 0; v < vectors; ++v) {
                            float *o = lane_out[lane] + 16 * v;
                            _mm512_storeu_ps(o, _mm512_fmadd_ps(weight, value[v], _mm512_loadu_ps(o)));
                        }
                    }
                    continue;
                }
#endif
                for (int64_t lane = 0; lane < lanes; ++lane) {
                    const float w = scores[lane * n + (j - lo)];
                    if (w != 0.0f) add_scaled(lane_out[lane], w, vj, dim, bf16); /* zero: masked (or vanishing) */
                }
            }
        }
        for (int64_t lane = 0; lane < lanes; ++lane) {
            const float inv = 1.0f / sums[lane];
            for (int64_t d = 0; d < dim; ++d) lane_out[lane][d] *= inv;
        }
        free(scores);
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (tiles) _tile_release();
#endif
    }
    free(task_start);
    return failed;
}
