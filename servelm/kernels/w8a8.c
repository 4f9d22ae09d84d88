/* int8 x int8 GEMM for W8A8 linear layers (servelm/models/w8a8.py), for
 * AVX512-VNNI CPUs: out = x W^T (+ bias) with W int8 [N, K] times one float32
 * scale per output row, and x quantized per row on the fly (symmetric, one
 * scale per row). vpdpbusd multiplies 64 pairs of bytes and adds them into 16
 * int32 sums in one instruction: twice the multiply-adds per instruction of
 * vdpbf16ps, so a compute-bound GEMM (prefill, large batches) can run up to
 * twice bfloat16's rate.
 *
 * vpdpbusd takes unsigned bytes on one side: each activation q in [-127, 127]
 * is stored as q + 128, and the extra 128 * sum_k w[n][k] of each output is
 * subtracted once at the end (its "compensation", computed when the weight is
 * packed).
 *
 * The packed weight (w8a8_pack): N rounded up to 16 (Np), K to 4 (Kp), zeros
 * in the padding; element (n, k) at ((n / 16) * (Kp / 4) + k / 4) * 64 +
 * (n % 16) * 4 + k % 4, so that 16 outputs x 4 of K are one vector; then Np
 * int32 compensations. A tile of up to TILE_ROWS rows x TILE_BLOCKS blocks of
 * 16 outputs keeps its sums in registers, each row's 4 bytes broadcast
 * against each block's vector; threads split the outputs into panels of
 * TILE_BLOCKS blocks (a panel's weights stay in the core's L2 while every
 * row passes over them). Elsewhere w8a8_supported() is 0 and callers keep
 * PyTorch's path. Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define W8A8_VNNI 1
#endif

#define TILE_ROWS 6   /* 6 rows x 4 blocks of sums, 4 of weights, 1 broadcast: 29 of the 32 registers */
#define TILE_BLOCKS 4 /* 64 outputs per panel */
#define CHUNK_ROWS 48 /* rows per work item: items split the rows too when there are few panels */

/* The tile's loops run a constant number of times once inlined: unrolled, its sums stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

int w8a8_supported(void) {
#ifdef W8A8_VNNI
    return 1;
#else
    return 0;
#endif
}

int64_t w8a8_packed_bytes(int64_t N, int64_t K) { return round_up(N, 16) * round_up(K, 4) + 4 * round_up(N, 16); }

void w8a8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *packed, int nthreads) {
    const int64_t Np = round_up(N, 16), Kp = round_up(K, 4);
    int32_t *comp = (int32_t *)(packed + Np * Kp);
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t block = 0; block < Np / 16; block++) {
        int8_t *dst = packed + block * 16 * Kp;
        memset(dst, 0, (size_t)(16 * Kp));
        for (int64_t j = 0; j < 16; j++) {
            const int64_t n = block * 16 + j;
            int32_t sum = 0;
            for (int64_t k = 0; n < N && k < K; k++) {
                dst[(k / 4) * 64 + j * 4 + k % 4] = w[n * K + k];
                sum += w[n * K + k];
            }
            comp[n] = 128 * sum;
        }
    }
}

#ifdef W8A8_VNNI
/* Row m of x (bfloat16 bits or float32) as Kp bytes q + 128 (the padding 128: zero), and its scale. */
static void quantize_row(const void *x, int x_bf16, int64_t m, int64_t K, int64_t Kp, uint8_t *q, float *scale) {
    const uint16_t *xb = (const uint16_t *)x + m * K;
    const float *xf = (const float *)x + m * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = (__mmask16)(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, xb + k)) : _mm512_maskz_loadu_ps(mask, xf + k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    *scale = top / 127.f;
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    const __m512i zero_point = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 in = (__mmask16)(K - k >= 16 ? 0xFFFF : K > k ? (1u << (K - k)) - 1 : 0);
        const __mmask16 out = (__mmask16)(Kp - k >= 16 ? 0xFFFF : (1u << (Kp - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(in, xb + k)) : _mm512_maskz_loadu_ps(in, xf + k);
        /* round to nearest even; |v| * inv <= 127, so q + 128 is in [1, 255] */
        const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zero_point);
        _mm_mask_storeu_epi8(q + k, out, _mm512_cvtepi32_epi8(qi));
    }
}

/* The int32 sums of ROWS rows of q x BLOCKS blocks of 16 outputs, into sums[r][16 * b + j]. Each (ROWS,
 * BLOCKS) is its own small function (tile_R_B below), so that its 24 sums get registers of their own. */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t Kp, const int8_t *w,
                                                      int32_t (*sums)[64], int ROWS, int BLOCKS) {
    __m512i acc[TILE_ROWS * TILE_BLOCKS];
    UNROLL for (int i = 0; i < ROWS * BLOCKS; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < Kp / 4; k4++) {
        __m512i wv[TILE_BLOCKS];
        UNROLL for (int b = 0; b < BLOCKS; b++) wv[b] = _mm512_loadu_si512(w + b * 16 * Kp + k4 * 64);
        UNROLL for (int r = 0; r < ROWS; r++) {
            int32_t four;
            memcpy(&four, q + r * Kp + 4 * k4, sizeof four);
            const __m512i xv = _mm512_set1_epi32(four);
            UNROLL for (int b = 0; b < BLOCKS; b++) acc[r * BLOCKS + b] = _mm512_dpbusd_epi32(acc[r * BLOCKS + b], xv, wv[b]);
        }
    }
    UNROLL for (int r = 0; r < ROWS; r++)
        UNROLL for (int b = 0; b < BLOCKS; b++) _mm512_storeu_si512(sums[r] + 16 * b, acc[r * BLOCKS + b]);
}

typedef void (*tile_fn)(const uint8_t *, int64_t, const int8_t *, int32_t (*)[64]);
#define TILE_FN(R, B)                                                                                            \
    static __attribute__((noinline)) void tile_##R##_##B(const uint8_t *q, int64_t Kp, const int8_t *w,        \
                                                         int32_t (*sums)[64]) {                                  \
        tile(q, Kp, w, sums, R, B);                                                                              \
    }
#define TILE_FNS(R) TILE_FN(R, 1) TILE_FN(R, 2) TILE_FN(R, 3) TILE_FN(R, 4)
TILE_FNS(1) TILE_FNS(2) TILE_FNS(3) TILE_FNS(4) TILE_FNS(5) TILE_FNS(6)
#define TILE_ROW(R) {tile_##R##_1, tile_##R##_2, tile_##R##_3, tile_##R##_4}
static const tile_fn TILES[TILE_ROWS][TILE_BLOCKS] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3),
                                                      TILE_ROW(4), TILE_ROW(5), TILE_ROW(6)};

/* out[r][n0 + j] = (sums[r][j] - comp) * row scale * output scale + bias, for rows x cols (masked past N). */
static void scale_out(int32_t (*sums)[64], int rows, int64_t cols, const float *row_scales, const int32_t *comp,
                      const float *scales, const void *bias, int x_bf16, int64_t n0, int64_t N, void *out) {
    for (int64_t j = 0; j < cols; j += 16) {
        const int64_t n = n0 + j;
        const __mmask16 mask = (__mmask16)(N - n >= 16 ? 0xFFFF : (1u << (N - n)) - 1);
        const __m512i c = _mm512_loadu_si512(comp + n);
        const __m512 s = _mm512_maskz_loadu_ps(mask, scales + n);
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + n))
                        : _mm512_maskz_loadu_ps(mask, (const float *)bias + n);
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums[r] + j), c));
            const __m512 y = _mm512_fmadd_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(row_scales[r])), bv);
            if (x_bf16) {
                uint16_t *o = (uint16_t *)out + r * N + n;
#ifdef __AVX512BF16__
                _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(y));
#else
                float tmp[16];
                _mm512_storeu_ps(tmp, y);
                for (int i = 0; i < 16 && n + i < N; i++) o[i] = f32_to_bf16(tmp[i]);
#endif
            } else {
                _mm512_mask_storeu_ps((float *)out + r * N + n, mask, y);
            }
        }
    }
}
#endif

void w8a8_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *packed, const float *scales,
               const void *bias, int64_t N, void *out, int nthreads) {
#ifdef W8A8_VNNI
    const int64_t Np = round_up(N, 16), Kp = round_up(K, 4);
    const int32_t *comp = (const int32_t *)(packed + Np * Kp);
    uint8_t *q = aligned_alloc(64, (size_t)round_up(M * Kp, 64));
    float *row_scales = malloc(sizeof(float) * (size_t)M);
    const int64_t panels = (Np / 16 + TILE_BLOCKS - 1) / TILE_BLOCKS, chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const size_t out_size = x_bf16 ? 2 : 4;
    /* One parallel region for both loops: on a busy machine each region's start waits until every thread
     * is scheduled again, which can cost more than the GEMM itself. */
    _Pragma("omp parallel num_threads(nthreads)") {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_bf16, m, K, Kp, q + m * Kp, row_scales + m);
    _Pragma("omp for collapse(2) schedule(static) nowait") /* the region's end waits */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = p * TILE_BLOCKS * 16, m0 = c * CHUNK_ROWS;
            const int64_t blocks = (Np - n0) / 16 < TILE_BLOCKS ? (Np - n0) / 16 : TILE_BLOCKS;
            const int64_t rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
            const int8_t *w = packed + n0 * Kp;
            int32_t sums[TILE_ROWS][64] __attribute__((aligned(64)));
            for (int64_t m = m0; m < m0 + rows; m += TILE_ROWS) {
                const int r = M - m < TILE_ROWS ? (int)(M - m) : TILE_ROWS;
                TILES[r - 1][blocks - 1](q + m * Kp, Kp, w, sums);
                scale_out(sums, r, 16 * blocks, row_scales + m, comp, scales, bias, x_bf16, n0, N,
                          (char *)out + (size_t)(m * N) * out_size);
            }
        }
    }
    free(q);
    free(row_scales);
#endif
}
