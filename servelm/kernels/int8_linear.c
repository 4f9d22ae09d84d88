/* Weight-only int8 matrix-vector product, for CPUs: out[n] = scale[n] *
 * sum_k x[k] * w[n, k], x and out bfloat16, w int8 with one bfloat16 scale
 * per output row (servelm/models/quantization.py). Decoding one sequence is
 * bound by reading the weights: each is read once, as int8, and widened in
 * registers.
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* One row of x; larger batches take PyTorch's int8 kernel. */
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
