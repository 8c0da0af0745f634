/* What the kernels that use AMX tiles share (included by gemv.c and paged_attention.c under __AMX_BF16__ and
 * __AMX_TILE__): the tile configuration, the process's permission, and rounding 16 floats to bfloat16 in
 * vector lanes. */
#ifndef DEEPINFER_CPU_AMX_H
#define DEEPINFER_CPU_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The layout _tile_loadconfig reads (palette 1): bytes per row and rows of each of the 8 tiles. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Whether this process may use AMX tiles (Linux grants the tile state on request, once per process). */
static int amx_permitted(void) {
    static int state; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* 16 floats rounded to bfloat16 as float_to_bf16 does (to nearest even; a NaN stays a NaN), in integer lanes. */
static inline __m256i bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), high = _mm512_srli_epi32(u, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i even = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, _mm512_set1_epi32(0x40))));
}

/* The rows x [rows, K] (rows ≤ 16) rounded to bf16 in a B tile's layout, xv[k / 32][(k % 32) / 2][m][k % 2]: per
 * row and chunk of 32 k, its 16 pairs as 32-bit words scattered `rows` words apart (element by element, with a
 * scalar rounding each, this packing cost ~0.45 ms per input row over a SmolLM2 step: most of what a verification
 * row added to it). */
static void pack_pairs(const float *x, uint16_t *xv, int64_t rows, int64_t K) {
    uint32_t *words = (uint32_t *)xv;
    const __m512i apart = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)rows));
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t kc = 0; kc < K / 32; ++kc) {
            const float *from = x + m * K + kc * 32;
            const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(_mm512_loadu_ps(from))),
                                                     bf16x16(_mm512_loadu_ps(from + 16)), 1);
            _mm512_i32scatter_epi32(words + kc * 16 * rows + m, apart, pairs, 4);
        }
}
#endif
