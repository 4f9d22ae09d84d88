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

/* x: [K] bfloat16, w: [N, K] bfloat16, bias: [N] or NULL; out: [N]. */
void bf16_gemv(const uint16_t *x, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N, uint16_t *out,
               int nthreads) {
    float *xf = malloc(sizeof(float) * (size_t)K);
    for (int64_t i = 0; i < K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(wn[k]) * xf[k];
        out[n] = f32_to_bf16(bias ? acc + bf16_to_f32(bias[n]) : acc);
    }
    free(xf);
}

/* x: [K] bfloat16, w: [N, K] int8, scales: [N] bfloat16; out: [N]. */
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads) {
    float *xf = malloc(sizeof(float) * (size_t)K);
    for (int64_t i = 0; i < K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; k++) acc += (float)wn[k] * xf[k];
        out[n] = f32_to_bf16(acc * bf16_to_f32(scales[n]));
    }
    free(xf);
}
