/* Fused elementwise ops of the decoder, for CPUs: each replaces a chain of
 * small PyTorch ops (8 for a norm, 20 for RoPE on q and k) whose per-op
 * overhead dominates at small batch; and the sampler's one pass over the
 * logits (log_softmax_stats; its random draw is in sample.c). Every rounding matches the PyTorch
 * code it replaces (servelm/models/llama.py): float32 arithmetic, results
 * rounded to the tensor's dtype where PyTorch's intermediate would be (exp's
 * last bit, theirs or PyTorch's, can still tip a bfloat16 rounding now and
 * then). Built at first use by servelm/kernels. */
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "bf16.h"
#include "kernels.h"
#include "vexp.h"


/* Threads pay off from about 16 thousand elements: with SmolLM2's norms (18,432 elements) and RoPE (30,720) at
 * 32 decoding rows threaded (serial below 32,768 before), and the int8 K/V writes, a 32-row step's forward ran
 * 2.2-3.0% faster with w8a8 and the int8 cache, 0.8-1.0% in bfloat16, steps alternating in one process
 * (docs/BENCHMARKS.md). */
#define PARALLEL _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(rows * width >= 16384)")

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
            o[i] = STORE(ROUND(silu(LOAD(g[i]))) * LOAD(u[i]));                                     \
        }                                                                                           \
    }                                                                                               \
}

DEFINE_NORM(bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16_round)
DEFINE_NORM(f32, float, f32_identity, f32_identity, f32_identity)
DEFINE_ROPE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROPE(f32, float, f32_identity, f32_identity)
DEFINE_SILU_MUL(f32, float, f32_identity, f32_identity, f32_identity)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The bfloat16 SiLU * up on AVX512-BF16: libmvec's expf and a divide made it
 * compute-bound, several times slower than a copy of the same bytes; this exp
 * and a refined reciprocal are faster (docs/BENCHMARKS.md). Its results
 * differ from PyTorch's (and the portable loop's) in about one element in a
 * thousand, by one bfloat16 step (vexp.h's silu_mul16_bf16). */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inner, int nthreads) {
    const int64_t width = inner;
    PARALLEL
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inner, *u = g + inner;
        uint16_t *o = out + r * inner;
        int64_t i = 0;
        for (; i + 16 <= inner; i += 16) _mm256_storeu_si256((__m256i *)(o + i), silu_mul16_bf16(widen16(g + i), widen16(u + i)));
        for (; i < inner; i++) o[i] = f32_to_bf16(bf16_round(silu(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
    }
}
#else
DEFINE_SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16, bf16_round)
#endif

/* One row of log_softmax_stats: its largest value (the first NaN if it has one, as torch.max) at *at, and
 * log(sum of exp(x - largest)), NaN where the largest is not finite, as log_softmax's row then is. */
static float row_stats(const float *x, int64_t V, float *largest, int64_t *at) {
    int64_t i = 0;
    float m = -INFINITY;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        if (_mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), inf_bits)) break; /* NaN */
        vm = _mm512_max_ps(vm, v);
    }
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < V; i++) {
        if (f32_is_nan(x[i])) {
            *largest = x[i];
            *at = i;
            return x[i];
        }
        m = x[i] > m ? x[i] : m;
    }
    *largest = m;
    *at = -1;
    /* double: without AVX-512 the loop below sums every exp one after another, and a float32 sum of 150,000
     * terms drifted 50x further from the true logsum than PyTorch's (5e-5 against 7e-7, Zen 1 with AVX2). */
    double sum = 0.;
    int64_t searched = 0; /* x[0..searched) holds no m unless *at says where */
    i = 0;
    if (f32_is_finite(m)) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        __m512 vs = _mm512_setzero_ps();
        const __m512 vmax = _mm512_set1_ps(m), floor = _mm512_set1_ps(-200.f); /* exp16(-inf) is NaN; e^-200, 0 */
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            if (*at < 0) {
                const __mmask16 hit = _mm512_cmp_ps_mask(v, vmax, _CMP_EQ_OQ);
                if (hit) *at = i + __builtin_ctz(hit);
            }
            vs = _mm512_add_ps(vs, exp16(_mm512_max_ps(_mm512_sub_ps(v, vmax), floor)));
            lanes_into_sum(i, &vs, &sum);
        }
        sum += (double)_mm512_reduce_add_ps(vs);
        searched = i;
#endif
        for (; i < V; i++) sum += expf(x[i] - m);
    }
    if (*at < 0) /* not met above: in the tail, or an infinite largest */
        for (i = searched; i < V; i++)
            if (x[i] == m) {
                *at = i;
                break;
            }
    if (*at < 0) *at = 0; /* cannot happen: m is one of x's values */
    if (!f32_is_finite(m)) return NAN;
    return (float)log(sum);
}

void log_softmax_stats_f32(const float *x, int64_t rows, int64_t V, int64_t stride, float *largest, int64_t *at,
                           float *logsum, int nthreads) {
    const int64_t width = V;
    PARALLEL
    for (int64_t r = 0; r < rows; r++) logsum[r] = row_stats(x + r * stride, V, largest + r, at + r);
}

/* This step's K and V rows into their cache slots: row t of key (value), at
 * key + t * stride bytes, row_bytes long, goes to slot slots[t] of k_cache
 * (v_cache). A copy per row; PyTorch's index_copy_ spends far longer setting
 * up than copying for rows this small. */
void write_kv(char *k_cache, char *v_cache, const char *key, const char *value, int64_t stride, const int64_t *slots,
              int64_t rows, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++) {
        memcpy(k_cache + slots[t] * row_bytes, key + t * stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * stride, (size_t)row_bytes);
    }
}
