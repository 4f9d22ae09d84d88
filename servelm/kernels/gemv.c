/* Matrix-vector products for batch-1 decoding, for CPUs: out = x W^T for one
 * row x, W either plain bfloat16 or int8 with one bfloat16 scale per output
 * row (servelm/models/quantization.py). Decoding one sequence is bound by
 * reading the weights, and these loops stream each weight row once, widening
 * it in registers, at close to memory speed: about twice what oneDNN's
 * prepacked GEMV and PyTorch's int8 kernel reach for one row.
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float int8_to_f32(int8_t v) { return (float)v; }

/* The loop both share: output row n streams weight row n once, widened to
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

/* x: [K] bfloat16, w: [N, K] bfloat16, bias: [N] or NULL; out: [N]. */
void bf16_gemv(const uint16_t *x, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N, uint16_t *out,
               int nthreads) {
    GEMV_ROWS(uint16_t, bf16_to_f32, bias ? acc + bf16_to_f32(bias[n]) : acc)
}

/* x: [K] bfloat16, w: [N, K] int8, scales: [N] bfloat16; out: [N]. */
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads) {
    GEMV_ROWS(int8_t, int8_to_f32, acc * bf16_to_f32(scales[n]))
}
