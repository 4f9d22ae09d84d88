/* Matrix-vector products for batch-1 decoding, for CPUs: out = x W^T for one
 * row x, W either plain bfloat16 or int8 with one bfloat16 scale per output
 * row (servelm/models/quantization.py). Decoding one sequence is bound by
 * reading the weights; these loops stream each weight row once, at close to
 * memory speed: about twice what oneDNN's prepacked GEMV and PyTorch's int8
 * kernel reach for one row (bench/gemm.py, bench/quantized.py).
 *
 * On AVX-512 CPUs each thread takes four rows at a time: four independent
 * chains of multiply-adds hide the instructions' latency (one chain per row
 * waits on each add), and the next four rows are prefetched while these are
 * summed, which keeps more of the memory bus busy than the hardware
 * prefetcher alone. bfloat16 rows go through vdpbf16ps (AVX512-BF16), which
 * multiplies pairs of bfloat16 and adds them in float32 without widening
 * anything. Elsewhere a portable loop that the compiler vectorises runs.
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMV_AVX512 1
#endif

#define GROUP 4 /* rows summed side by side */

static inline float int8_to_f32(int8_t v) { return (float)v; }

/* The portable loop: output row n streams weight row n once, widened to
 * float32 by W_LOAD, and stores the bfloat16 of RESULT (an expression of acc
 * and n). */
#define GEMV_ROWS(W_T, W_LOAD, RESULT)                                           \
    float *xf = malloc(sizeof(float) * (size_t)K);                               \
    for (int64_t i = 0; i < K; i++) xf[i] = bf16_to_f32(x[i]);                   \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")           \
    for (int64_t n = 0; n < N; n++) {                                            \
        const W_T *wn = w + n * K;                                               \
        float acc = 0.f;                                                         \
        _Pragma("omp simd reduction(+ : acc)")                                   \
        for (int64_t k = 0; k < K; k++) acc += W_LOAD(wn[k]) * xf[k];            \
        out[n] = f32_to_bf16(RESULT);                                            \
    }                                                                            \
    free(xf);

#ifdef GEMV_AVX512
/* Mask of the first `count` (< 64) lanes. */
static inline uint64_t first_lanes(int64_t count) { return (UINT64_C(1) << count) - 1; }

#ifdef __AVX512BF16__
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
            _mm_prefetch((const char *)(w + (r + GROUP) * K + k), _MM_HINT_T0);
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
        for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(w + (r + GROUP) * K + k), _MM_HINT_T0);
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

/* Rows in groups of GROUP over the threads, the last N % GROUP one by one;
 * DOTS(rows, n, sums) fills sums[0..rows) for rows n.., RESULT(acc, n) is
 * what row n stores before rounding. */
#define GEMV_GROUPS(DOTS, RESULT)                                                \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")           \
    for (int64_t g = 0; g < (N + GROUP - 1) / GROUP; g++) {                      \
        int64_t n0 = g * GROUP;                                                  \
        float sums[GROUP];                                                       \
        int rows = N - n0 < GROUP ? (int)(N - n0) : GROUP;                       \
        if (rows == GROUP) {                                                     \
            DOTS(GROUP, n0, sums);                                               \
        } else {                                                                 \
            for (int r = 0; r < rows; r++) DOTS(1, n0 + r, sums + r);            \
        }                                                                        \
        for (int r = 0; r < rows; r++) {                                         \
            float acc = sums[r];                                                 \
            int64_t n = n0 + r;                                                  \
            out[n] = f32_to_bf16(RESULT);                                        \
        }                                                                        \
    }
#endif

/* x: [K] bfloat16, w: [N, K] bfloat16, bias: [N] or NULL; out: [N]. */
void bf16_gemv(const uint16_t *x, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N, uint16_t *out,
               int nthreads) {
#if defined(GEMV_AVX512) && defined(__AVX512BF16__)
#define BF16_DOTS(rows, n, sums) bf16_dots(x, K, w + (n) * K, rows, sums)
    GEMV_GROUPS(BF16_DOTS, bias ? acc + bf16_to_f32(bias[n]) : acc)
#else
    GEMV_ROWS(uint16_t, bf16_to_f32, bias ? acc + bf16_to_f32(bias[n]) : acc)
#endif
}

/* x: [K] bfloat16, w: [N, K] int8, scales: [N] bfloat16; out: [N]. */
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads) {
#ifdef GEMV_AVX512
    float *xf = malloc(sizeof(float) * (size_t)K);
    for (int64_t i = 0; i < K; i++) xf[i] = bf16_to_f32(x[i]);
#define INT8_DOTS(rows, n, sums) int8_dots(xf, K, w + (n) * K, rows, sums)
    GEMV_GROUPS(INT8_DOTS, acc * bf16_to_f32(scales[n]))
    free(xf);
#else
    GEMV_ROWS(int8_t, int8_to_f32, acc * bf16_to_f32(scales[n]))
#endif
}
