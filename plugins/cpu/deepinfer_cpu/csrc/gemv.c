/* A few input rows times a row-major float32 or bfloat16 weight on the CPU (deepinfer_cpu/gemv.py and
 * decode_step.c call it): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x [M, K], w [N, K], out [M, N], all
 * contiguous; the projections of decode and verification steps.
 *
 * OpenMP splits the output rows n; each thread streams one weight row at a time (one sequential stream per
 * thread: two to four at once ran ~2× slower over a SmolLM2 step on the 2-core VM) against up to BLOCK input
 * rows, then again from L1 for the next BLOCK. Each (input row, weight row) pair keeps 64 partial sums in
 * independent FMA chains of SIMD vectors (GCC vector extensions), folded by a fixed tree, then the K % 64 tail
 * in order. That order is the same whatever M is, so a row's result is bitwise the same alone or beside others:
 * a verification step's rows equal decode steps'. It is another order than a BLAS GEMV's. Any K.
 * The vector width is the dtype's: float32 weights 8 chains of 8-float (ymm) vectors, bf16 weights 4 chains of
 * 16-float (zmm with AVX-512) vectors — on the 2-core AMD VM 16-float vectors ran a one-row float32 step 5–15%
 * slower and 8-float ones a bf16 step ~20% slower end to end. scripts/bench_cpu_gemv_sweep.py measures it
 * against oneDNN's packed GEMM at 1–8 rows.
 *
 * gemv_bf16: on a CPU with AVX512-BF16 (the compiler's __AVX512BF16__ under -march=native) the input rows are
 * rounded to bfloat16 once per call (exact in a bf16 model, whose activations are bfloat16 values) and each pair of
 * products is summed by vdpbf16ps into float32 chains: 4 chains of 32 weights, folded as above, then the K % 32 tail
 * in order — half the instructions of widening every weight, which held the one-row bf16 GEMV at ~46 GB/s where
 * float32 streams ~60. Without it each bf16 weight vector is widened exactly to float32 where it is loaded (a
 * 16-bit shift) and shared by the block's rows; x and out stay float32.
 *
 * On a CPU with AMX-BF16 (Sapphire Rapids and later; __AMX_BF16__ under -march=native, and Linux granting the
 * process the tile state) a bf16 weight whose N and K are multiples of 32 goes through the tile unit instead:
 * the weight is the tiles' A operand as it lies (16 weight rows × 32 k a tile: no repacked copy), up to 32
 * input rows, rounded to bf16 and laid out in the unit's pairs, the B operand (two tiles of 16). One pass over the
 * weight serves all 32 rows at close to the memory's speed, where the vector kernels above pay per row: on a 2-core
 * Xeon VM a SmolLM2 step's projections took 13.6 / 14.3 / 16.3 / 20.8 ms at 1 / 6 / 16 / 32 rows, oneDNN's packed
 * GEMM 22.8 / 21.9 / 23.5 / 28.1 and the vdpbf16ps kernel ~2× per added row (scripts/bench_cpu_gemv_sweep.py;
 * from 48 rows oneDNN is ahead). Each output is its own tile element, so its sum runs in the same order whatever
 * the rows beside it: bitwise alone or together, as above (another order than vdpbf16ps's).
 * gemv_bf16_kernel(N, K) says which kernel serves a shape. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "bf16.h"

#define LANES 64
#define BLOCK 4

typedef float floats8 __attribute__((vector_size(32), aligned(4)));     /* any 4-byte alignment */
typedef float floats16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t halves16 __attribute__((vector_size(32), aligned(2)));  /* 16 bfloat16 */
typedef uint32_t words16 __attribute__((vector_size(64)));

static inline floats16 widen(const uint16_t *w) { /* 16 bfloat16 → float32, exactly */
    const words16 bits = __builtin_convertvector(*(const halves16 *)w, words16) << 16;
    floats16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* One pair's vector sums into total: the chains folded pairwise (chain c += chain c + width, width halving), then
 * the vector's lanes likewise (the caller adds the K % LANES tail). */
#define FOLD(WIDTH, CHAINS, chains, total)                                                                     \
    do {                                                                                                       \
        for (int width = (CHAINS) / 2; width > 0; width /= 2)                                                  \
            for (int c = 0; c < width; ++c) chains[c] += chains[c + width];                                    \
        float lanes[WIDTH];                                                                                    \
        memcpy(lanes, &chains[0], sizeof lanes);                                                               \
        for (int width = (WIDTH) / 2; width > 0; width /= 2)                                                   \
            for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];                                      \
        total = lanes[0];                                                                                      \
    } while (0)

/* The weight's cache lines PREFETCH_AHEAD bytes past those a pass is about to read are requested while it computes:
 * the hardware prefetcher alone kept a float32 SmolLM2 step's projections at ~27 GB/s at one row and ~19 at six on
 * the 2-core Xeon VM; asked 3 KB ahead they ran 12% / 20% faster (1 KB: 9% / 17%, 4 KB: less steady;
 * scripts/bench_cpu_gemv_sweep.py). Past the end of the weight the requests are harmless (a prefetch never faults).
 * The AMX path does not use it: there it ran 5–10% slower. */
#define PREFETCH_AHEAD 3072

static inline void prefetch_ahead(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + i);
}

/* NAME(x, w, out, N, K, bias, rows): out[m * N] for m < rows, input rows x [rows, K] against one weight row w of
 * WEIGHT elements, in CHAINS chains of VEC vectors (WIDTH floats) loaded by LOAD(w + k) and folded by FOLD, then
 * the tail in order through SCALAR(w[k]). rows is a constant at each call below, so every inlined copy keeps its
 * rows × CHAINS sums in registers. */
#define DOT_BLOCK(NAME, WEIGHT, VEC, WIDTH, CHAINS, LOAD, SCALAR)                                              \
    __attribute__((always_inline)) static inline void NAME(const float *x, const WEIGHT *w, float *out,       \
                                                           int64_t N, int64_t K, float bias, const int rows) { \
        const int64_t body = K - K % LANES;                                                                    \
        VEC acc[BLOCK][CHAINS];                                                                                \
        _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)                                                 \
            _Pragma("GCC unroll 8") for (int c = 0; c < (CHAINS); ++c) acc[m][c] = (VEC){0};                   \
        for (int64_t k = 0; k < body; k += LANES) {                                                            \
            prefetch_ahead(w + k, LANES * (int64_t)sizeof(WEIGHT));                                            \
            _Pragma("GCC unroll 8") for (int c = 0; c < (CHAINS); ++c) {                                       \
                const VEC weights = LOAD(w + k + (WIDTH) * c);                                                 \
                _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)                                         \
                    acc[m][c] += *(const VEC *)(x + m * K + k + (WIDTH) * c) * weights;                        \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m) {                                               \
            float total;                                                                                       \
            FOLD(WIDTH, CHAINS, acc[m], total);                                                                \
            for (int64_t k = body; k < K; ++k) total += x[m * K + k] * SCALAR(w[k]);                           \
            out[m * N] = total + bias;                                                                         \
        }                                                                                                      \
    }

#define LOAD_F32(p) (*(const floats8 *)(p))
#define AS_FLOAT(v) (v)
DOT_BLOCK(dot_block_f32, float, floats8, 8, 8, LOAD_F32, AS_FLOAT)
DOT_BLOCK(dot_block_bf16, uint16_t, floats16, 16, 4, widen, bf16_to_float)

enum kind { F32, BF16_WIDEN, BF16_DP }; /* the weights' dtype, and for bf16 how its products are summed */

#ifdef __AVX512BF16__
#define DP_DOT(r) dot_block_dp(xb + m0 * K, (const uint16_t *)w + n * K, out + m0 * N + n, N, K, b, r)
#else
#define DP_DOT(r) (void)xb
#endif

#define BLOCK_CASE(r)                                                                                          \
    case r:                                                                                                    \
        if (kind == F32)                                                                                       \
            dot_block_f32(x + m0 * K, (const float *)w + n * K, out + m0 * N + n, N, K, b, r);                 \
        else if (kind == BF16_WIDEN)                                                                           \
            dot_block_bf16(x + m0 * K, (const uint16_t *)w + n * K, out + m0 * N + n, N, K, b, r);             \
        else                                                                                                   \
            DP_DOT(r);                                                                                         \
        break;

#ifdef __AVX512BF16__
#define DP_CHAINS 4
/* dot_block_dp(xb, w, out, N, K, bias, rows): as DOT_BLOCK's functions, for bfloat16 rows xb [rows, K] (rounded
 * once per call) against one bfloat16 weight row, 32 weights a vdpbf16ps, DP_CHAINS chains. */
__attribute__((always_inline)) static inline void dot_block_dp(const uint16_t *xb, const uint16_t *w, float *out,
                                                               int64_t N, int64_t K, float bias, const int rows) {
    const int64_t body = K - K % (32 * DP_CHAINS);
    __m512 acc[BLOCK][DP_CHAINS];
    _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)
        _Pragma("GCC unroll 4") for (int c = 0; c < DP_CHAINS; ++c) acc[m][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32 * DP_CHAINS) {
        _Pragma("GCC unroll 4") for (int c = 0; c < DP_CHAINS; ++c) {
            const __m512bh weights = (__m512bh)_mm512_loadu_si512(w + k + 32 * c);
            _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)
                acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_loadu_si512(xb + m * K + k + 32 * c),
                                             weights);
        }
    }
    for (int64_t k = body; k + 32 <= K; k += 32) { /* whole vectors past the chains' body: chain 0, in order */
        const __m512bh weights = (__m512bh)_mm512_loadu_si512(w + k);
        _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xb + m * K + k), weights);
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < rows; ++m) {
        float total;
        FOLD(16, DP_CHAINS, acc[m], total);
        for (int64_t k = K - K % 32; k < K; ++k) total += bf16_to_float(xb[m * K + k]) * bf16_to_float(w[k]);
        out[m * N] = total + bias;
    }
}

#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h"
#define AMX_ROWS 32 /* input rows per pass over the weight (two B tiles of 16 column pairs) */

/* out[m, n0 … n0 + 15] = c[0 … 15][m] (+ bias) for m < rows: a C tile (weight rows × input rows) transposed into
 * the output rows, one 16-float gather and store per row (element by element this store took a quarter of a 16-row
 * SmolLM2 step: 21.2 against 16.7 ms, and 9% of a one-row step; scripts/bench_cpu_gemv_sweep.py). */
static inline void store_transposed(float c[16][16], int64_t rows, const float *bias, float *out, int64_t N,
                                    int64_t n0) {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m)
        _mm512_storeu_ps(out + m * N + n0, _mm512_add_ps(_mm512_i32gather_ps(column, &c[0][m], 4), b));
}

/* A pass reads its block's 32 weight rows side by side, 64 bytes of each per chunk of 32 k: 32 streams at once,
 * more than the hardware prefetcher follows. Each chunk asks for the line AMX_AHEAD chunks on in every row (past
 * the block's end: the next block's rows, the thread's next under the static schedule); a SmolLM2 step's bf16
 * projections 9.3 -> 8.7 ms at one row, 16.0 -> 13.7 at 32 (scripts/bench_cpu_gemv_sweep.py). */
#define AMX_AHEAD 4

static inline void prefetch_rows(const uint16_t *w0, int64_t chunk, int64_t K) {
    if (chunk < 0) return;
    const int64_t chunks = K / 32;
    const uint16_t *at = chunk < chunks ? w0 + chunk * 32 : w0 + 32 * K + (chunk - chunks) * 32;
    for (int64_t r = 0; r < 32; ++r) _mm_prefetch((const char *)(at + r * K), _MM_HINT_T0);
}

/* out[m, n] for m < rows (≤ AMX_ROWS), the weight as the tiles' A operand (16 weight rows × 32 k, read where it
 * lies: no repacked copy) against the rows in VNNI pairs as B: up to two groups of 16 rows (group g's chunk kc at
 * xv + (g · K / 32 + kc) · 32 · 16, laid out by pack_pairs), so one pass over the weight serves 32 rows. Tiles: C
 * 0, 1 (group 0) and 5, 6 (group 1), A 2, 3, B 4 (group 0) and 7 (group 1). */
static void amx_rows(const uint16_t *xv, const uint16_t *w, const float *bias, float *out, int64_t rows, int64_t N,
                     int64_t K, int threads) {
    const int64_t blocks = N / 32, chunks = K / 32, first = rows < 16 ? rows : 16, second = rows - first;
    const uint16_t *xv1 = xv + chunks * 32 * 16;
#pragma omp parallel num_threads(threads)
    {
        struct tile_config cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 2; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = (uint16_t)(first * 4); }      /* C, group 0 */
        for (int t = 2; t < 4; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }                         /* A */
        cfg.rows[4] = 16; cfg.colsb[4] = (uint16_t)(first * 4);                                      /* B, group 0 */
        if (second) {
            for (int t = 5; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = (uint16_t)(second * 4); } /* C, group 1 */
            cfg.rows[7] = 16; cfg.colsb[7] = (uint16_t)(second * 4);                                 /* B, group 1 */
        }
        _tile_loadconfig(&cfg);
        float c[16][16];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const uint16_t *w0 = w + b * 32 * K, *w1 = w0 + 16 * K;
            const int64_t n0 = b * 32;
            _tile_zero(0);
            _tile_zero(1);
            if (second) {
                _tile_zero(5);
                _tile_zero(6);
            }
            for (int64_t kc = 0; kc < chunks; ++kc) {
                prefetch_rows(w0, kc + AMX_AHEAD < chunks || b + 1 < blocks ? kc + AMX_AHEAD : -1, K);
                _tile_loadd(2, w0 + kc * 32, K * 2);
                _tile_loadd(3, w1 + kc * 32, K * 2);
                _tile_loadd(4, xv + kc * 32 * first, first * 4);
                if (second) _tile_loadd(7, xv1 + kc * 32 * second, second * 4);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
                if (second) {
                    _tile_dpbf16ps(5, 2, 7);
                    _tile_dpbf16ps(6, 3, 7);
                }
            }
            _tile_stored(0, c, 64);
            store_transposed(c, first, bias, out, N, n0);
            _tile_stored(1, c, 64);
            store_transposed(c, first, bias, out, N, n0 + 16);
            if (second) {
                _tile_stored(5, c, 64);
                store_transposed(c, second, bias, out + first * N, N, n0);
                _tile_stored(6, c, 64);
                store_transposed(c, second, bias, out + first * N, N, n0 + 16);
            }
        }
        _tile_release();
    }
}

static int amx_serves(int64_t N, int64_t K) { return N % 32 == 0 && K % 32 == 0 && amx_permitted(); }

/* The AMX path when the shape allows it (amx_serves); 0 if not taken (or no memory for the paired rows). */
static int gemv_bf16_amx(const float *x, const uint16_t *w, const float *bias, float *out, int64_t M, int64_t N,
                         int64_t K, int threads) {
    if (!amx_serves(N, K)) return 0;
    uint16_t *xv = malloc(sizeof(uint16_t) * (size_t)(AMX_ROWS * K));
    if (xv == NULL) return 0;
    for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
        const int64_t rows = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
        const int64_t first = rows < 16 ? rows : 16;
        pack_pairs(x + m0 * K, xv, first, K);
        if (rows > first) pack_pairs(x + (m0 + first) * K, xv + K * 16, rows - first, K);
        amx_rows(xv, w, bias, out + m0 * N, rows, N, K, threads);
    }
    free(xv);
    return 1;
}
#endif

/* xb: the rows rounded to bf16 (BF16_DP only). */
static void gemv(const float *x, const uint16_t *xb, const void *w, const float *bias, float *out, int64_t M, int64_t N,
                 int64_t K, int threads, enum kind kind) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += BLOCK) {
            switch (M - m0 < BLOCK ? M - m0 : BLOCK) {
                BLOCK_CASE(1)
                BLOCK_CASE(2)
                BLOCK_CASE(3)
                BLOCK_CASE(4)
            }
        }
    }
}

void gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
              int threads) {
    gemv(x, NULL, w, bias, out, M, N, K, threads, F32);
}

void gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
               int threads) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (gemv_bf16_amx(x, w, bias, out, M, N, K, threads)) return;
#endif
    enum kind kind = BF16_WIDEN;
    uint16_t *xb = NULL;
#ifdef __AVX512BF16__
    xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (xb != NULL) { /* else (no memory for the rounded rows) the widening kernel, in its own summation order */
        for (int64_t i = 0; i < M * K; ++i) xb[i] = float_to_bf16(x[i]);
        kind = BF16_DP;
    }
#endif
    gemv(x, xb, w, bias, out, M, N, K, threads, kind);
    free(xb);
}

/* Which kernel gemv_bf16 runs for an [N, K] weight: 2 the AMX tiles, 1 vdpbf16ps, 0 the widening kernel. */
int gemv_bf16_kernel(int64_t N, int64_t K) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx_serves(N, K)) return 2;
#endif
    (void)N;
    (void)K;
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
