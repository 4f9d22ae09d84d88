/* Fused elementwise ops of the decoder, for CPUs: each replaces a chain of
 * small PyTorch ops (8 for a norm, 20 for RoPE on q and k) whose per-op
 * overhead dominates at small batch. Every rounding matches the PyTorch
 * code it replaces (servelm/models/llama.py): float32 arithmetic, results
 * rounded to the tensor's dtype where PyTorch's intermediate would be.
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Threads only pay off above a few tens of thousands of elements. */
#define PARALLEL _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(rows * width >= 32768)")

/* out[i] = w * round(x * rsqrt(mean(x^2) + eps)) per row of ``hidden``; with
 * ``residual`` non-null, first residual = round(residual + x) and the norm is
 * taken of the new residual (x is then the sublayer's output). */
#define DEFINE_NORM(SUFFIX, T, LOAD, STORE, ROUND)                                                   \
void add_rms_norm_##SUFFIX(const T *x, T *residual, const T *w, T *out, int64_t rows, int64_t hidden, \
                           float eps, int nthreads) {                                                \
    const int64_t width = hidden;                                                                   \
    PARALLEL                                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                            \
        const T *xr = x + r * hidden;                                                               \
        T *res = residual ? residual + r * hidden : 0;                                              \
        float sq = 0.f;                                                                             \
        if (res) {                                                                                  \
            _Pragma("omp simd reduction(+:sq)")                                                     \
            for (int64_t i = 0; i < hidden; i++) {                                                  \
                const float v = ROUND(LOAD(res[i]) + LOAD(xr[i]));                                   \
                res[i] = STORE(v);                                                                  \
                sq += v * v;                                                                        \
            }                                                                                       \
            xr = res;                                                                               \
        } else {                                                                                    \
            _Pragma("omp simd reduction(+:sq)")                                                     \
            for (int64_t i = 0; i < hidden; i++) sq += LOAD(xr[i]) * LOAD(xr[i]);                   \
        }                                                                                           \
        const float inv = 1.f / sqrtf(sq / (float)hidden + eps);                                    \
        T *o = out + r * hidden;                                                                    \
        _Pragma("omp simd")                                                                         \
        for (int64_t i = 0; i < hidden; i++) o[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xr[i]) * inv));   \
    }                                                                                               \
}

/* Rotate-half RoPE in place on the first ``heads`` heads of each row of
 * ``x`` (row stride ``stride`` elements; q and k heads sit side by side in
 * the fused QKV output). cos_sin: [positions, D] float32, cos then sin. */
#define DEFINE_ROPE(SUFFIX, T, LOAD, STORE)                                                          \
void rope_##SUFFIX(T *x, int64_t rows, int64_t stride, int64_t heads, int64_t D,                    \
                   const float *cos_sin, const int64_t *positions, int nthreads) {                  \
    const int64_t half = D / 2, width = heads * D;                                                  \
    PARALLEL                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                            \
        const float *c = cos_sin + positions[r] * D, *s = c + half;                                 \
        for (int64_t h = 0; h < heads; h++) {                                                       \
            T *x1 = x + r * stride + h * D, *x2 = x1 + half;                                        \
            _Pragma("omp simd")                                                                     \
            for (int64_t i = 0; i < half; i++) {                                                    \
                const float a = LOAD(x1[i]), b = LOAD(x2[i]);                                       \
                x1[i] = STORE(a * c[i] - b * s[i]);                                                 \
                x2[i] = STORE(b * c[i] + a * s[i]);                                                 \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}

/* out = round(silu(gate)) * up, for gate_up rows [gate | up] of 2 * inner. */
#define DEFINE_SILU_MUL(SUFFIX, T, LOAD, STORE, ROUND)                                               \
void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inner, int nthreads) {       \
    const int64_t width = inner;                                                                    \
    PARALLEL                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                            \
        const T *g = gate_up + r * 2 * inner, *u = g + inner;                                       \
        T *o = out + r * inner;                                                                     \
        _Pragma("omp simd")                                                                         \
        for (int64_t i = 0; i < inner; i++) {                                                       \
            const float v = LOAD(g[i]);                                                             \
            o[i] = STORE(ROUND(v / (1.f + expf(-v))) * LOAD(u[i]));                                 \
        }                                                                                           \
    }                                                                                               \
}

DEFINE_NORM(bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16_round)
DEFINE_NORM(f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_ROPE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROPE(f32, float, f32_identity, f32_identity)
DEFINE_SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16_round)
DEFINE_SILU_MUL(f32, float, f32_identity, f32_identity, f32_identity)

/* This step's K and V rows into their cache slots: row t of key (value), at
 * key + t * stride bytes, row_bytes long, goes to slot slots[t] of k_cache
 * (v_cache). A copy per row; PyTorch's index_copy_ spends ~40x as long
 * setting up for rows this small. */
void write_kv(char *k_cache, char *v_cache, const char *key, const char *value, int64_t stride, const int64_t *slots,
              int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++) {
        memcpy(k_cache + slots[t] * row_bytes, key + t * stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * stride, (size_t)row_bytes);
    }
}
