/* Weight-only quantized linear layers on the CPU, float32 activations (deepinfer_cpu/quant_linear.py loads
 * it through ctypes): out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w stored in one of two formats.
 *
 *   int8:  w[n, k] = scale[n, k / group] * q[n, k]; q int8 [N, K], scale float32 [N, K / group] (group = K:
 *          one scale per output row; group = 32: llama.cpp's Q8_0 blocks).
 *   q4_1:  blocks of 32 inputs along k, as llama.cpp's Q4_1: w[n, 32 b + j] = d[n, b] * q + mn[n, b] with q the
 *          low nibble of qs[n, 16 b + j] for j < 16 and the high nibble of qs[n, 16 b + j - 16] for j >= 16;
 *          qs uint8 [N, K / 2], d and mn float16 [N, K / 32] (5 bits per weight, as in a GGUF file).
 *
 * One input row (M = 1, a batch-1 decode step) takes a fused matrix-vector loop: each weight is converted
 * and multiplied where it is loaded, the scale applied once per block (q4_1's minimum through the block's
 * input sum: sum_j x_j (d q_j + m) = d sum_j x_j q_j + m sum_j x_j). Several input rows: each OpenMP task
 * takes ROWS output rows, expands their weights to float32 once into a small buffer (L1), then runs every
 * input row against them, so the quantized weight is read from memory once per call and expanded once per
 * call, whatever M is. Sums run in float32 in SIMD lanes (another order than a BLAS GEMM).
 * K must be a multiple of group (int8) or of 32 (q4_1); the caller checks. Functions return 0, or 1 when a
 * buffer could not be allocated.
 *
 * The *_q8 entry points quantize the input rows too, as llama.cpp does for its Q4_1 / Q8_0 dot products:
 * each block of 32 inputs becomes int8 codes a with a float32 step s = max|x| / 127 (x ~ s a), and a weight
 * block's contribution is its step(s) times an integer dot product: q4_1 d s (q . a) + m s sum(a), int8
 * scale s (q . a) — exactly the rounded inputs s a times the weights, up to the order of the float sums.
 * A row's result does not depend on the other rows of the call (the same operations in the same order).
 * With AVX512-VNNI (vpdpbusd) a block's 32 products are one instruction; without it, a plain integer loop.
 * For q4_1 under VNNI the codes of each full pair of input blocks are stored interleaved, [first's 0..15,
 * second's 0..15, first's 16..31, second's 16..31]: the order in which the pair's 32 packed weight bytes
 * unpack into low and high nibbles, so a pair takes one weight load and two products. The products and
 * their int32 sums are exact, so these differ from the float32 path only by the input rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VNNI 1
#endif

#define ROWS 4

static void expand_int8_row(const int8_t *q, const float *scale, int64_t K, int64_t group, float *dst) {
    for (int64_t b = 0; b < K / group; ++b) {
        const int8_t *src = q + group * b;
        float *out = dst + group * b;
        const float s = scale[b];
#pragma omp simd
        for (int64_t j = 0; j < group; ++j) out[j] = s * (float)src[j];
    }
}

static void expand_q4_1_row(const uint8_t *qs, const _Float16 *d, const _Float16 *mn, int64_t K, float *dst) {
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t *src = qs + 16 * b;
        float *out = dst + 32 * b;
        const float scale = (float)d[b], low = (float)mn[b];
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
            out[j] = scale * (float)(src[j] & 15) + low;
            out[j + 16] = scale * (float)(src[j] >> 4) + low;
        }
    }
}

/* out rows [n0, n0 + rows) of every input row, from the expanded weights w [rows][K]. */
static void multiply(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int64_t n0, int64_t rows) {
    for (int64_t m = 0; m < M; ++m) {
        const float *xm = x + m * K;
        if (rows == ROWS) {
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t k = 0; k < K; ++k) {
                const float v = xm[k];
                a0 += v * w0[k];
                a1 += v * w1[k];
                a2 += v * w2[k];
                a3 += v * w3[k];
            }
            float *o = out + m * N + n0;
            o[0] = a0 + (bias ? bias[n0] : 0.0f);
            o[1] = a1 + (bias ? bias[n0 + 1] : 0.0f);
            o[2] = a2 + (bias ? bias[n0 + 2] : 0.0f);
            o[3] = a3 + (bias ? bias[n0 + 3] : 0.0f);
        } else {
            for (int64_t r = 0; r < rows; ++r) {
                float acc = 0.0f;
                const float *wr = w + r * K;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; ++k) acc += xm[k] * wr[k];
                out[m * N + n0 + r] = acc + (bias ? bias[n0 + r] : 0.0f);
            }
        }
    }
}

/* M = 1: out[n] = sum over blocks of scale * (x . q) (+ bias). The sums stay in 16 lanes across blocks (the
 * block's scale folded into each lane's product), so no block pays a horizontal reduction. */
static void gemv_int8(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                      int64_t N, int64_t K, int64_t group, int threads) {
    const int64_t blocks = K / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t *row = q + n * K;
        float total = 0.0f;
        if (group % 16 == 0 && blocks > 1) {
            float lanes[16] = {0.0f};
            for (int64_t b = 0; b < blocks; ++b) {
                const float s = scale[n * blocks + b];
                for (int64_t j = b * group; j < (b + 1) * group; j += 16) {
#pragma omp simd
                    for (int l = 0; l < 16; ++l) lanes[l] += s * (x[j + l] * (float)row[j + l]);
                }
            }
            for (int l = 0; l < 16; ++l) total += lanes[l];
        } else {
            for (int64_t b = 0; b < blocks; ++b) {
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t j = b * group; j < (b + 1) * group; ++j) acc += x[j] * (float)row[j];
                total += acc * scale[n * blocks + b];
            }
        }
        out[n] = total + (bias ? bias[n] : 0.0f);
    }
}

/* M = 1, q4_1: per block d * (x . q) + m * sum(x); xsum [K / 32] holds the block sums of x. Lanes as above. */
static void gemv_q4_1(const float *x, const float *xsum, const uint8_t *qs, const _Float16 *d, const _Float16 *mn,
                      const float *bias, float *out, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        float lanes[16] = {0.0f}, low = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *src = qs + n * (K / 2) + 16 * b;
            const float *xb = x + 32 * b;
            const float step = (float)d[n * blocks + b];
#pragma omp simd
            for (int l = 0; l < 16; ++l)
                lanes[l] += step * (xb[l] * (float)(src[l] & 15) + xb[l + 16] * (float)(src[l] >> 4));
            low += (float)mn[n * blocks + b] * xsum[b];
        }
        float total = low;
        for (int l = 0; l < 16; ++l) total += lanes[l];
        out[n] = total + (bias ? bias[n] : 0.0f);
    }
}

/* A quantized weight matrix in one of the two formats (the header comment's fields). */
typedef enum { INT8, Q4_1 } Format;
typedef struct {
    Format format;
    const int8_t *q;
    const float *scale;
    int64_t group;
    const uint8_t *qs;
    const _Float16 *d;
    const _Float16 *mn;
} Weights;

static void expand_row(const Weights *wt, int64_t n, int64_t K, float *dst) {
    if (wt->format == INT8)
        expand_int8_row(wt->q + n * K, wt->scale + n * (K / wt->group), K, wt->group, dst);
    else
        expand_q4_1_row(wt->qs + n * (K / 2), wt->d + n * (K / 32), wt->mn + n * (K / 32), K, dst);
}

/* Several input rows: each task expands ROWS output rows' weights once, then runs every input row on them. */
static int expand_and_multiply(const float *x, const Weights *wt, const float *bias, float *out, int64_t M,
                               int64_t N, int64_t K, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = malloc(sizeof(float) * (size_t)(ROWS * K));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
            if (w == NULL) continue;
            const int64_t rows = N - n0 < ROWS ? N - n0 : ROWS;
            for (int64_t r = 0; r < rows; ++r) expand_row(wt, n0 + r, K, w + r * K);
            multiply(x, w, bias, out, M, N, K, n0, rows);
        }
        free(w);
    }
    return failed;
}

int linear_int8_f32(const float *x, const int8_t *q, const float *scale, const float *bias, float *out,
                    int64_t M, int64_t N, int64_t K, int64_t group, int threads) {
    if (M == 1) {
        gemv_int8(x, q, scale, bias, out, N, K, group, threads);
        return 0;
    }
    const Weights wt = {INT8, q, scale, group, NULL, NULL, NULL};
    return expand_and_multiply(x, &wt, bias, out, M, N, K, threads);
}

int linear_q4_1_f32(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                    float *out, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = K / 32;
    if (M == 1) {
        float *xsum = malloc(sizeof(float) * (size_t)blocks);
        if (xsum == NULL) return 1;
        for (int64_t b = 0; b < blocks; ++b) {
            float acc = 0.0f;
            for (int j = 0; j < 32; ++j) acc += x[32 * b + j];
            xsum[b] = acc;
        }
        gemv_q4_1(x, xsum, qs, d, mn, bias, out, N, K, threads);
        free(xsum);
        return 0;
    }
    const Weights wt = {Q4_1, NULL, NULL, 0, qs, d, mn};
    return expand_and_multiply(x, &wt, bias, out, M, N, K, threads);
}

/* ---------------------------------------------------------------- quantized inputs (the *_q8 entry points) */

/* Row x [K] as blocks of 32 int8 codes: a [K], steps s [K / 32], and the sums of the rounded inputs s sum(a)
 * [K / 32]; with interleave each full pair of blocks in the header comment's order. */
static void quantize_input_row(const float *x, int64_t K, int8_t *a, float *s, float *xsum, int interleave) {
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        const float *xb = x + 32 * b;
        /* where the block's codes 0..15 and 16..31 go (interleaved pairs: the header comment's order) */
        const int paired = interleave && (b | 1) < blocks, second = (int)(b & 1);
        int8_t *first_half = a + (paired ? 32 * (b - second) + 16 * second : 32 * b);
        int8_t *second_half = first_half + (paired ? 32 : 16);
#ifdef VNNI
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        /* round to nearest even, as lrintf in the default rounding mode */
        const __m512 scale = _mm512_set1_ps(inv);
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, scale));
        const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, scale));
        _mm_storeu_si128((__m128i *)first_half, _mm512_cvtsepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)second_half, _mm512_cvtsepi32_epi8(c1));
        const int32_t codes = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(xb[j]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t codes = 0;
        for (int j = 0; j < 16; ++j) {
            first_half[j] = (int8_t)lrintf(xb[j] * inv);
            second_half[j] = (int8_t)lrintf(xb[j + 16] * inv);
            codes += first_half[j] + second_half[j];
        }
#endif
        const float step = amax / 127.0f;
        s[b] = step;
        xsum[b] = step * (float)codes;
    }
}

#ifdef VNNI
static inline float sum_lanes(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* 32 nibbles (16 bytes: low nibbles are inputs 0..15, high ones 16..31) times 32 int8 inputs, in 8 int32 lanes. */
static inline __m256i dot_q4_q8(const uint8_t *qs, const int8_t *a) {
    const __m128i nibble = _mm_set1_epi8(15), packed = _mm_loadu_si128((const __m128i *)qs);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *)a));
}
#endif

#ifdef VNNI
#define ROW_GROUP 4
/* One q4_1 weight row against count (1..ROW_GROUP) quantized input rows (codes K apart, steps and sums
 * blocks apart): eight blocks at a time, their steps d s and minimum terms m s sum(a) as vectors; then each
 * pair of weight blocks is loaded and unpacked once for all the rows, and each row's products go into two
 * chains (pairs alternate), an odd last block into the first. Every row takes the same operations in the
 * same order whatever count is, so a row's result does not depend on the rows beside it. */
static void rows_q4_1_q8(const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const int8_t *a, const float *s,
                         const float *xsum, int64_t blocks, int64_t K, int count, float *result) {
    const __m256i nibbles = _mm256_set1_epi8(15);
    __m256 acc[ROW_GROUP][2], lows[ROW_GROUP];
    float steps[ROW_GROUP][8];
    for (int r = 0; r < ROW_GROUP; ++r) acc[r][0] = acc[r][1] = lows[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
        const int n = blocks - b0 < 8 ? (int)(blocks - b0) : 8;
        const __mmask8 mask = (__mmask8)((1u << n) - 1);
        const __m256 weight_steps = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, d + b0));
        const __m256 minima = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask, mn + b0));
        for (int r = 0; r < count; ++r) {
            _mm256_storeu_ps(steps[r], _mm256_mul_ps(weight_steps, _mm256_maskz_loadu_ps(mask, s + r * blocks + b0)));
            lows[r] = _mm256_fmadd_ps(minima, _mm256_maskz_loadu_ps(mask, xsum + r * blocks + b0), lows[r]);
        }
        int j = 0;
        for (; j + 1 < n; j += 2) { /* a pair: lanes 0..3 sum the first block, 4..7 the second */
            const int64_t b = b0 + j;
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 16 * b));
            const __m256i low_codes = _mm256_and_si256(packed, nibbles);
            const __m256i high_codes = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibbles);
            for (int r = 0; r < count; ++r) {
                const int8_t *ar = a + r * K + 32 * b;
                const __m256i dots = _mm256_dpbusd_epi32(
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), low_codes, _mm256_loadu_si256((const __m256i *)ar)),
                    high_codes, _mm256_loadu_si256((const __m256i *)(ar + 32)));
                const __m256 pair_steps = _mm256_set_m128(_mm_broadcast_ss(steps[r] + j + 1),
                                                          _mm_broadcast_ss(steps[r] + j));
                acc[r][(j >> 1) & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), pair_steps, acc[r][(j >> 1) & 1]);
            }
        }
        if (j < n) { /* the rows' odd last block, codes in natural order */
            const int64_t b = b0 + j;
            for (int r = 0; r < count; ++r)
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_q4_q8(qs + 16 * b, a + r * K + 32 * b)),
                                            _mm256_broadcast_ss(steps[r] + j), acc[r][0]);
        }
    }
    for (int r = 0; r < count; ++r)
        result[r] = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), lows[r]));
}
#endif

/* One q4_1 weight row against one quantized input row: sum over blocks of d s (q . a) + m s sum(a). */
static float row_q4_1_q8(const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const int8_t *a, const float *s,
                         const float *xsum, int64_t blocks) {
#ifdef VNNI
    float dot;
    rows_q4_1_q8(qs, d, mn, a, s, xsum, blocks, 0, 1, &dot); /* the rows' code: the same result as in a group */
    return dot;
#else
    float total = 0.0f, low = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *src = qs + 16 * b;
        const int8_t *ab = a + 32 * b;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (src[j] & 15) * ab[j] + (src[j] >> 4) * ab[j + 16];
        total += (float)dot * ((float)d[b] * s[b]);
        low += (float)mn[b] * xsum[b];
    }
    return total + low;
#endif
}

/* One int8 weight row (a scale per group inputs, group a multiple of 32) against one quantized input row. */
static float row_int8_q8(const int8_t *q, const float *scale, int64_t group, const int8_t *a, const float *s,
                         int64_t blocks) {
    const int64_t per_group = group / 32;
#ifdef VNNI
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a + 32 * b));
        /* vpdpbusd multiplies unsigned by signed bytes: |a| times w with a's sign (|a| <= 127) */
        const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x),
                                                 _mm256_sign_epi8(w, x));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(scale[b / per_group] * s[b]), acc);
    }
    return sum_lanes(acc);
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += q[32 * b + j] * a[32 * b + j];
        total += (float)dot * (scale[b / per_group] * s[b]);
    }
    return total;
#endif
}

/* Every input row quantized once, then each task runs its output rows against all of them. */
static int linear_q8(const float *x, const Weights *wt, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int threads) {
    const int64_t blocks = K / 32;
    int8_t *a = malloc((size_t)(M * K));
    float *s = malloc(sizeof(float) * (size_t)(M * blocks)), *xsum = malloc(sizeof(float) * (size_t)(M * blocks));
    if (a == NULL || s == NULL || xsum == NULL) {
        free(a), free(s), free(xsum);
        return 1;
    }
#ifdef VNNI
    const int interleave = wt->format == Q4_1;
#else
    const int interleave = 0;
#endif
    for (int64_t m = 0; m < M; ++m)
        quantize_input_row(x + m * K, K, a + m * K, s + m * blocks, xsum + m * blocks, interleave);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
#ifdef VNNI
        if (wt->format == Q4_1 && M > 1) { /* groups of input rows share each weight block's unpacking */
            for (int64_t m0 = 0; m0 < M; m0 += ROW_GROUP) {
                const int count = M - m0 < ROW_GROUP ? (int)(M - m0) : ROW_GROUP;
                float dots[ROW_GROUP];
                rows_q4_1_q8(wt->qs + n * (K / 2), wt->d + n * blocks, wt->mn + n * blocks, a + m0 * K,
                             s + m0 * blocks, xsum + m0 * blocks, blocks, K, count, dots);
                for (int r = 0; r < count; ++r) out[(m0 + r) * N + n] = dots[r] + (bias ? bias[n] : 0.0f);
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < M; ++m) {
            const int8_t *am = a + m * K;
            const float *sm = s + m * blocks;
            const float dot = wt->format == Q4_1
                ? row_q4_1_q8(wt->qs + n * (K / 2), wt->d + n * blocks, wt->mn + n * blocks, am, sm,
                              xsum + m * blocks, blocks)
                : row_int8_q8(wt->q + n * K, wt->scale + n * (K / wt->group), wt->group, am, sm, blocks);
            out[m * N + n] = dot + (bias ? bias[n] : 0.0f);
        }
    }
    free(a), free(s), free(xsum);
    return 0;
}

int linear_int8_q8(const float *x, const int8_t *q, const float *scale, const float *bias, float *out, int64_t M,
                   int64_t N, int64_t K, int64_t group, int threads) {
    const Weights wt = {INT8, q, scale, group, NULL, NULL, NULL};
    return linear_q8(x, &wt, bias, out, M, N, K, threads);
}

int linear_q4_1_q8(const float *x, const uint8_t *qs, const _Float16 *d, const _Float16 *mn, const float *bias,
                   float *out, int64_t M, int64_t N, int64_t K, int threads) {
    const Weights wt = {Q4_1, NULL, NULL, 0, qs, d, mn};
    return linear_q8(x, &wt, bias, out, M, N, K, threads);
}
