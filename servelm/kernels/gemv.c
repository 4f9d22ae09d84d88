/* Matrix-vector products for batch-1 decoding, for CPUs: out = x W^T for one
 * row x (bfloat16 and float32 ones for a few rows too), W plain bfloat16 or
 * float32, or int8 with one bfloat16 scale per output row
 * (servelm/models/quantization.py). Decoding one sequence is bound by
 * reading the weights; these loops stream each weight row once, at close to
 * memory speed, faster than oneDNN's prepacked GEMV and PyTorch's int8 kernel
 * for one row (bench/gemm.py, bench/quantized.py).
 *
 * On AVX-512 CPUs each thread takes four rows at a time: four independent
 * chains of multiply-adds hide the instructions' latency (one chain per row
 * waits on each add), and the rows two groups on are prefetched into L2
 * while these are summed, which keeps more of the memory bus busy than the
 * hardware prefetcher alone. Into L2, not L1: on Zen 4 a prefetch into L1
 * holds one of its few miss buffers. Prefetched into L1, the int8 rows
 * streamed at about 21 GB/s; into L2 at 32-50 GB/s, as fast per byte as the
 * pair layout of gemm_pairs.c. bfloat16 rows go
 * through vdpbf16ps (AVX512-BF16), which multiplies pairs of bfloat16 and
 * adds them in float32 without widening anything. AVX2 CPUs run the same
 * groups of rows and prefetches over 8 lanes, the weights (int8 or
 * bfloat16) widened to float32 for vfmadd: the portable loop that the
 * compiler vectorises keeps one chain of adds per row, which waits on each
 * add. Elsewhere that loop runs. Built at first use by servelm/kernels. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMV_AVX512 1
#ifdef __AVX512BF16__
#define GEMV_AVX512BF16 1 /* vdpbf16ps: the bfloat16 GEMV's vector loop and the small GEMM */
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 8 lanes, the same groups of rows: the float32 GEMV everywhere, the int8 and bfloat16 ones (the weights widened
 * to float32) where there is no AVX-512 */
#define GEMV_AVX2 1
#endif

#define GROUP 4 /* rows summed side by side */
#define AHEAD 2 /* groups between the rows summed and the rows prefetched */

static inline float int8_to_f32(int8_t v) { return (float)v; }

/* The portable loop: output row n streams weight row n once, widened to
 * float32 by W_LOAD, against each of the M rows of xf (x widened to float32),
 * and stores the STORE (rounding) of RESULT (an expression of acc and n). */
#define GEMV_ROWS(W_T, W_LOAD, RESULT, STORE)                                    \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")           \
    for (int64_t n = 0; n < N; n++) {                                            \
        const W_T *wn = w + n * K;                                               \
        for (int64_t m = 0; m < M; m++) {                                        \
            const float *xm = xf + m * K;                                        \
            float acc = 0.f;                                                     \
            _Pragma("omp simd reduction(+ : acc)")                               \
            for (int64_t k = 0; k < K; k++) acc += W_LOAD(wn[k]) * xm[k];        \
            out[m * N + n] = STORE(RESULT);                                      \
        }                                                                        \
    }

#ifdef GEMV_AVX512
/* Mask of the first `count` (< 64) lanes. */
static inline uint64_t first_lanes(int64_t count) { return (UINT64_C(1) << count) - 1; }

#ifdef GEMV_AVX512BF16
/* Dot products of `rows` (1..GROUP, a constant once inlined) weight rows
 * w[r * K ...] with x, into sums[r]. */
static inline __attribute__((always_inline)) void bf16_dots(const uint16_t *x, int64_t K, const uint16_t *w,
                                                            int rows, float *sums) {
    __m512 acc[GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) { /* 32 bfloat16 = one 64-byte cache line per row */
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int r = 0; r < rows; r++) {
            _mm_prefetch((const char *)(w + (r + AHEAD * GROUP) * K + k), _MM_HINT_T1);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
        }
    }
    if (k < K) {
        __mmask32 tail = (__mmask32)first_lanes(K - k);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + k), xv);
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

/* The same for int8 rows against x widened to float32 once (xf). */
static inline __attribute__((always_inline)) void int8_dots(const float *xf, int64_t K, const int8_t *w, int rows,
                                                            float *sums) {
    __m512 acc[GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) { /* 64 int8 = one cache line per row */
        for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(w + (r + AHEAD * GROUP) * K + k), _MM_HINT_T1);
        for (int j = 0; j < 64; j += 16) {
            __m512 xv = _mm512_loadu_ps(xf + k + j);
            for (int r = 0; r < rows; r++) {
                __m512i wi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + r * K + k + j)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wi), xv, acc[r]);
            }
        }
    }
    for (; k < K; k += 16) {
        __mmask16 tail = (__mmask16)first_lanes(K - k < 16 ? K - k : 16);
        __m512 xv = _mm512_maskz_loadu_ps(tail, xf + k);
        for (int r = 0; r < rows; r++) {
            __m512i wi = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, w + r * K + k));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wi), xv, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

#endif

#ifdef GEMV_AVX2
/* The sum of v's 8 lanes. */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 bfloat16 at p widened to float32. */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 int8 at p as float32. */
static inline __m256 int8x8(const int8_t *p) {
    int64_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}

#define AVX2_XROWS 3 /* rows of x against each widened vector of weights: 12 sums (4 x 3), 3 x, 1 weight: 16 registers */

/* Dot products of `rows` (1..GROUP) weight rows w[r * K ...] (float32, or bfloat16 or int8 widened to it)
 * with `xrows` (1..AVX2_XROWS) rows of xf (x in float32, rows K apart), into sums[m * GROUP + r]: a cache
 * line of each weight row at a time, the rows two groups on prefetched into L2 meanwhile, as the AVX-512
 * loops do. Each sum is the same chain of multiply-adds whatever rows and xrows are. */
#define AVX2_DOTS(NAME, W_T, WIDEN, PER_LINE)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *xf, int xrows, int64_t K, const W_T *w, \
                                                           int rows, float *sums) {                            \
        __m256 acc[AVX2_XROWS][GROUP];                                                                         \
        float tail[AVX2_XROWS][GROUP] = {{0}};                                                                 \
        for (int m = 0; m < xrows; m++)                                                                        \
            for (int r = 0; r < rows; r++) acc[m][r] = _mm256_setzero_ps();                                    \
        int64_t k = 0;                                                                                         \
        for (; k + PER_LINE <= K; k += PER_LINE) {                                                             \
            for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(w + (r + AHEAD * GROUP) * K + k), _MM_HINT_T1); \
            for (int j = 0; j < PER_LINE; j += 8) {                                                            \
                __m256 xv[AVX2_XROWS];                                                                         \
                for (int m = 0; m < xrows; m++) xv[m] = _mm256_loadu_ps(xf + m * K + k + j);                   \
                for (int r = 0; r < rows; r++) {                                                               \
                    const __m256 wv = WIDEN(w + r * K + k + j);                                                \
                    for (int m = 0; m < xrows; m++) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);         \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (; k < K; k++)                                                                                     \
            for (int r = 0; r < rows; r++)                                                                     \
                for (int m = 0; m < xrows; m++)                                                                \
                    tail[m][r] = fmaf(WIDEN##_one(w[r * K + k]), xf[m * K + k], tail[m][r]);                  \
        for (int m = 0; m < xrows; m++)                                                                        \
            for (int r = 0; r < rows; r++) sums[m * GROUP + r] = sum8(acc[m][r]) + tail[m][r];                 \
    }
#define widen8_one bf16_to_f32
#define int8x8_one int8_to_f32
#define _mm256_loadu_ps_one f32_identity
AVX2_DOTS(f32_dots, float, _mm256_loadu_ps, 16)
#ifndef GEMV_AVX512BF16
AVX2_DOTS(bf16_dots_f32x, uint16_t, widen8, 32)
#endif
#ifndef GEMV_AVX512
AVX2_DOTS(int8_dots, int8_t, int8x8, 64)
#endif
#endif

/* x [M, K] bfloat16 widened to float32, in memory the caller frees. */
static float *widen_x(const uint16_t *x, int64_t M, int64_t K) {
    const int64_t count = M * K > 0 ? M * K : 1;
    float *xf = malloc(sizeof(float) * (size_t)count);
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    return xf;
}

#if defined(GEMV_AVX512) || defined(GEMV_AVX2)
/* Rows of W in groups of GROUP over the threads, the last N % GROUP one by
 * one, each group against the rows of x, XR at a time (then 2, then 1),
 * while its weights are in cache (XR is 1 where DOTS takes one row of x);
 * DOTS(rows, xrows, n, m, sums) fills sums[mm * GROUP + r] for weight rows
 * n.. and x rows m.., RESULT(acc, n) is what out[m][n] stores, rounded by
 * STORE (to bfloat16, or f32_identity). Each row of x is summed exactly as
 * it is when it comes alone: a speculative step's verified rows get plain
 * decoding's logits (models/packed.py). */
#define GEMV_GROUPS_TO(DOTS, XR, RESULT, STORE)                                   \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")            \
    for (int64_t g = 0; g < (N + GROUP - 1) / GROUP; g++) {                       \
        int64_t n0 = g * GROUP;                                                   \
        int rows = N - n0 < GROUP ? (int)(N - n0) : GROUP;                        \
        for (int64_t m0 = 0; m0 < M; m0 += XR) {                                  \
            if (M - m0 >= XR) {                                                   \
                GEMV_BLOCK(DOTS, XR, m0, RESULT, STORE);                          \
            } else if (M - m0 == 2) { /* XR is 3 or more */                       \
                GEMV_BLOCK(DOTS, 2, m0, RESULT, STORE);                           \
            } else {                                                              \
                for (int64_t m = m0; m < M; m++) GEMV_BLOCK(DOTS, 1, m, RESULT, STORE); \
            }                                                                     \
        }                                                                         \
    }
/* GEMV_GROUPS_TO's XN rows of x from m against the group's rows n0... */
#define GEMV_BLOCK(DOTS, XN, m, RESULT, STORE)                                    \
    do {                                                                          \
        float sums[(XN) * GROUP];                                                 \
        if (rows == GROUP) {                                                      \
            DOTS(GROUP, XN, n0, m, sums);                                         \
        } else {                                                                  \
            for (int r = 0; r < rows; r++) DOTS(1, XN, n0 + r, m, sums + r);      \
        }                                                                         \
        for (int mm = 0; mm < (XN); mm++)                                         \
            for (int r = 0; r < rows; r++) {                                      \
                float acc = sums[mm * GROUP + r];                                 \
                int64_t n = n0 + r;                                               \
                out[((m) + mm) * N + n] = STORE(RESULT);                          \
            }                                                                     \
    } while (0)
#define GEMV_GROUPS(DOTS, XR, RESULT) GEMV_GROUPS_TO(DOTS, XR, RESULT, f32_to_bf16)
#endif

/* x: [M, K] bfloat16, w: [N, K] bfloat16, bias: [N] or NULL; out: [M, N]. */
void bf16_gemv(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N,
               uint16_t *out, int nthreads) {
#ifdef GEMV_AVX512BF16
#define BF16_DOTS(rows, xrows, n, m, sums) bf16_dots(x + (m) * K, K, w + (n) * K, rows, sums)
    GEMV_GROUPS(BF16_DOTS, 1, bias ? acc + bf16_to_f32(bias[n]) : acc)
#else
    float *xf = widen_x(x, M, K);
#ifdef GEMV_AVX2
#define BF16_DOTS(rows, xrows, n, m, sums) bf16_dots_f32x(xf + (m) * K, xrows, K, w + (n) * K, rows, sums)
    GEMV_GROUPS(BF16_DOTS, AVX2_XROWS, bias ? acc + bf16_to_f32(bias[n]) : acc)
#else
    GEMV_ROWS(uint16_t, bf16_to_f32, bias ? acc + bf16_to_f32(bias[n]) : acc, f32_to_bf16)
#endif
    free(xf);
#endif
}

/* x: [M, K] float32, w: [N, K] float32, bias: [N] or NULL; out: [M, N]. oneDNN's GEMV over its prepacked
 * float32 weight read them at 11 GB/s on a Zen 1 with AVX2, these 8-lane loops at 18 (docs/BENCHMARKS.md). */
void f32_gemv(const float *x, int64_t M, int64_t K, const float *w, const float *bias, int64_t N, float *out,
              int nthreads) {
#ifdef GEMV_AVX2
#define F32_DOTS(rows, xrows, n, m, sums) f32_dots(x + (m) * K, xrows, K, w + (n) * K, rows, sums)
    GEMV_GROUPS_TO(F32_DOTS, AVX2_XROWS, bias ? acc + bias[n] : acc, f32_identity)
#else
    const float *xf = x;
    GEMV_ROWS(float, f32_identity, bias ? acc + bias[n] : acc, f32_identity)
#endif
}

/* x: [K] bfloat16, w: [N, K] int8, scales: [N] bfloat16; out: [N]. */
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads) {
    const int64_t M = 1;
    float *xf = widen_x(x, M, K);
#if defined(GEMV_AVX512) || defined(GEMV_AVX2)
#ifdef GEMV_AVX512
#define INT8_DOTS(rows, xrows, n, m, sums) int8_dots(xf, K, w + (n) * K, rows, sums)
#else
#define INT8_DOTS(rows, xrows, n, m, sums) int8_dots(xf, 1, K, w + (n) * K, rows, sums)
#endif
    GEMV_GROUPS(INT8_DOTS, 1, acc * bf16_to_f32(scales[n]))
#else
    GEMV_ROWS(int8_t, int8_to_f32, acc * bf16_to_f32(scales[n]), f32_to_bf16)
#endif
    free(xf);
}
