/* The small GEMM of decoding steps over weights in servelm's pair layout: on
 * the vector unit (AVX512-BF16) and on AMX tiles. Built at first use by
 * servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define GEMV_AVX512BF16 1 /* vdpbf16ps */
#endif

/* Products of a few rows, for decoding steps of a handful to a few dozen
 * sequences: out = x W^T (+ bias) for x [M, K], with W in the pair layout
 * below. oneDNN's prepacked GEMM runs well below its large-M rate here
 * (bench/gemm.py); this kernel keeps a tile of up to PAIR_ROWS rows x 32
 * outputs in registers, multiplies each 64-byte vector of weights (16
 * outputs x one pair of K) by the tile's rows' pair of x broadcast
 * (vdpbf16ps), and asks for the next 32 outputs' weights while it sums these
 * 32's tiles. AVX512-BF16 CPUs only; elsewhere bf16_pairs_supported() is 0
 * and callers keep oneDNN.
 *
 * The pair layout of W [N, K] (N a multiple of 32, K even): element (n, k)
 * at ((n / 16) * (K / 2) + k / 2) * 32 + (n % 16) * 2 + k % 2, so that the
 * 16 outputs of a block and one pair of K are one vector. */
int bf16_pairs_supported(void) {
#ifdef GEMV_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

void bf16_pack_pairs(const uint16_t *w, int64_t N, int64_t K, uint16_t *pairs, int nthreads) {
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t block = 0; block < N / 16; block++)
        for (int64_t p = 0; p < K / 2; p++)
            for (int64_t j = 0; j < 16; j++) {
                const uint16_t *src = w + (block * 16 + j) * K + 2 * p;
                uint16_t *dst = pairs + ((block * (K / 2) + p) * 16 + j) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#ifdef GEMV_AVX512BF16
#define PAIR_ROWS 12 /* 12 rows x 2 vectors of accumulators, 2 of weights: 26 of the 32 registers */

/* One pair of K for the tile's rows: the 2 weight vectors times each row's pair of x, broadcast. */
static inline __attribute__((always_inline)) void pair_step(const uint16_t *x, int64_t K, const uint16_t *w0,
                                                           const uint16_t *w1, int64_t p, int ROWS, __m512 *acc0,
                                                           __m512 *acc1) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32), v1 = (__m512bh)_mm512_loadu_si512(w1 + p * 32);
    for (int m = 0; m < ROWS; m++) {
        int32_t pair;
        memcpy(&pair, x + m * K + 2 * p, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        acc0[m] = _mm512_dpbf16_ps(acc0[m], v0, xv);
        acc1[m] = _mm512_dpbf16_ps(acc1[m], v1, xv);
    }
}

/* The tile's sums, asking for the next_lines lines at next meanwhile, per_pair lines a pair of K. */
static inline __attribute__((always_inline)) void pair_tile(const uint16_t *x, int64_t K, const uint16_t *w0,
                                                           const uint16_t *w1, int ROWS, const uint16_t *bias,
                                                           uint16_t *out, int64_t N, const char *next,
                                                           int64_t next_lines, int64_t per_pair) {
    __m512 acc0[PAIR_ROWS], acc1[PAIR_ROWS];
    for (int m = 0; m < ROWS; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p < K / 2 && p * per_pair < next_lines; p++) { /* the pairs that prefetch, then the rest without */
        for (int64_t line = p * per_pair; line < (p + 1) * per_pair && line < next_lines; line++)
            _mm_prefetch(next + line * 64, _MM_HINT_T1);
        pair_step(x, K, w0, w1, p, ROWS, acc0, acc1);
    }
    for (; p < K / 2; p++) pair_step(x, K, w0, w1, p, ROWS, acc0, acc1);
    const __m512 b0 = bias ? widen16(bias) : _mm512_setzero_ps(), b1 = bias ? widen16(bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; m++) {
        _mm256_storeu_si256((__m256i *)(out + m * N), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[m], b0)));
        _mm256_storeu_si256((__m256i *)(out + m * N + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[m], b1)));
    }
}
#endif

/* x: [M, K] bfloat16, pairs: W [N, K] in the pair layout, bias: [N] or NULL; out: [M, N]. */
void bf16_gemm_pairs(const uint16_t *x, int64_t M, int64_t K, const uint16_t *pairs, const uint16_t *bias,
                     int64_t N, uint16_t *out, int nthreads) {
#ifdef GEMV_AVX512BF16
    const int64_t block = 16 * K; /* elements of 16 outputs' weights */
    /* While a thread's 32 outputs are summed, each tile of rows asks for an even share of the next 32 outputs'
     * weights (most likely this thread's next), a line or more a pair of K. All of them during the first tile
     * ran 0.89x on the Qwen shape's down projection at 32 rows from memory, 0.94x on its LM head (Zen 5). */
    if (M <= 0) return;
    const int64_t tiles = (M + PAIR_ROWS - 1) / PAIR_ROWS, lines = 2 * block * (int64_t)sizeof(uint16_t) / 64;
    const int64_t steps = K / 2 > 0 ? K / 2 : 1; /* pairs of K */
    const int64_t share = (lines + tiles - 1) / tiles, per_pair = (share + steps - 1) / steps;
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t n32 = 0; n32 < N / 32; n32++) {
        const uint16_t *w0 = pairs + 2 * n32 * block, *w1 = w0 + block;
        const char *next = n32 + 1 < N / 32 ? (const char *)(w0 + 2 * block) : NULL;
        const uint16_t *b = bias ? bias + 32 * n32 : NULL;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m0 = t * PAIR_ROWS, rows = M - m0 < PAIR_ROWS ? M - m0 : PAIR_ROWS;
            const int64_t left = next ? lines - t * share : 0, pf_lines = left < share ? left : share;
            const char *pf = pf_lines > 0 ? next + t * share * 64 : NULL;
            uint16_t *o = out + m0 * N + 32 * n32;
            switch (rows) {
#define PAIR_CASE(n) case n: pair_tile(x + m0 * K, K, w0, w1, n, b, o, N, pf, pf_lines, per_pair); break;
                PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4) PAIR_CASE(5) PAIR_CASE(6)
                PAIR_CASE(7) PAIR_CASE(8) PAIR_CASE(9) PAIR_CASE(10) PAIR_CASE(11)
                default: pair_tile(x + m0 * K, K, w0, w1, PAIR_ROWS, b, o, N, pf, pf_lines, per_pair); break;
#undef PAIR_CASE
            }
        }
    }
#endif
}

/* The same products on the AMX tile unit (tdpbf16ps), for CPUs that have it, where oneDNN would run them
 * otherwise: the rows past what the AVX512-BF16 kernel above takes (packed.py). The pair layout is the tile
 * unit's own: 16 consecutive pairs of K for 16 outputs are a tile of 16 rows x 64 bytes. Each step of 32 of
 * K multiplies 2 tiles of 16 rows of x by the tiles of 2 blocks of 16 outputs into 4 tiles of float32 sums
 * (32 rows x 32 outputs), added in K's order; threads split the outputs. Needs K a multiple of 32 (a tile's
 * row); x is copied into a buffer whose rows past M are zeros, since tiles load 16 rows. Its sums are added
 * in another order than the AVX512-BF16 kernel's, so the two are not interchangeable row for row (a
 * speculative engine's verified rows all stay on that one: packed.pair_rows). */
int bf16_pairs_amx_supported(int64_t K) {
#ifdef KERNELS_AMX
    return K % 32 == 0 && amx_granted();
#else
    (void)K;
    return 0;
#endif
}

void bf16_gemm_pairs_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *pairs, const uint16_t *bias,
                         int64_t N, uint16_t *out, int nthreads) {
#ifdef KERNELS_AMX
    const int64_t Mp = (M + 31) / 32 * 32, row_bytes = 2 * K;
    uint16_t *xp = aligned_alloc(64, (size_t)(Mp * row_bytes));
    memcpy(xp, x, (size_t)(M * row_bytes));
    memset(xp + M * K, 0, (size_t)((Mp - M) * row_bytes));
    _Pragma("omp parallel num_threads(nthreads)") {
    amx_configure();
    _Pragma("omp for schedule(static) nowait")
    for (int64_t n32 = 0; n32 < N / 32; n32++) {
        const uint16_t *w0 = pairs + 32 * n32 * K, *w1 = w0 + 16 * K;
        float sums[32][32] __attribute__((aligned(64)));
        for (int64_t m = 0; m < M; m += 32) {
            const uint16_t *xm = xp + m * K;
            const int lower = M - m > 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < K; k += 32) {
                amx_prefetch_ahead(w0 + 16 * k); /* the weights stream from memory once per call */
                amx_prefetch_ahead(w1 + 16 * k);
                _tile_loadd(4, xm + k, row_bytes);
                _tile_loadd(6, w0 + 16 * k, 64);
                _tile_loadd(7, w1 + 16 * k, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (lower) {
                    _tile_loadd(5, xm + 16 * K + k, row_bytes);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 128);
            _tile_stored(1, sums[0] + 16, 128);
            _tile_stored(2, sums[16], 128);
            _tile_stored(3, sums[16] + 16, 128);
            const __m512 b0 = bias ? widen16(bias + 32 * n32) : _mm512_setzero_ps();
            const __m512 b1 = bias ? widen16(bias + 32 * n32 + 16) : _mm512_setzero_ps();
            for (int64_t r = 0; r < 32 && m + r < M; r++) {
                uint16_t *o = out + (m + r) * N + 32 * n32;
                _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[r]), b0)));
                _mm256_storeu_si256((__m256i *)(o + 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[r] + 16), b1)));
            }
        }
    }
    _tile_release();
    }
    free(xp);
#else
    (void)x, (void)M, (void)K, (void)pairs, (void)bias, (void)N, (void)out, (void)nthreads;
#endif
}
