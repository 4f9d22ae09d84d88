/* SiLU (one value, and 16 lanes times up) and exp over 16 float32 lanes, for the kernels and the attention's
 * softmax (below): libmvec's expf, which GCC calls from vectorized loops, cost several times more. */
#pragma once
#include <math.h>
#include <stdint.h>

/* SiLU with e = exp(-|v|), at most 1: v / (1 + e) for v >= 0 and v * e /
 * (1 + e) below never overflows (exp(-v) is inf below about -88, and
 * -ffast-math lets the compiler assume no infinity: v / (1 + inf) came out NaN). */
static inline float silu(float v) {
    const float e = expf(-fabsf(v));
    return v * (v < 0.f ? e : 1.f) / (1.f + e);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 1 / k! for k = 0..7: exp16's Taylor coefficients. */
static const float inv_factorial[8] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

/* exp(x), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so that r stays exact), e^r by its
 * Taylor series to r^degree, times 2^n (vscalefps: overflow to inf and underflow to 0 as expf does). Degree
 * 7 is about an ulp; degree 5 is within 2.4e-6 (r^6 / 720), ample for a result rounded to bfloat16. */
static inline __m512 exp16_degree(__m512 x, int degree) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(inv_factorial[degree]);
    for (int k = degree - 1; k >= 0; k--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_factorial[k]));
    return _mm512_scalef_ps(p, n);
}

/* exp(x) to about an ulp, 16 lanes. */
static inline __m512 exp16(__m512 x) { return exp16_degree(x, 7); }

#ifdef __AVX512BF16__
/* round(silu(g)) * u for 16 lanes of bfloat16 values g and u (widened), rounded to bfloat16 (its bits): SiLU
 * * up as the bfloat16 layers compute it. sigmoid(g) = 1 / (1 + e) with e = exp(-g), -g at most 88 so that e
 * stays finite (below g = -88 SiLU is then 0 where PyTorch's is -0 or about 1e-37); e to degree 5, the
 * reciprocal to 14 bits, then one Newton step. Against exp(-|g|) to degree 7 with the sign handled apart: a
 * 32-row w8a8 decoding step's forward 0.5-1.0% faster, steps alternating in one process (docs/BENCHMARKS.md). */
static inline __m256i silu_mul16_bf16(__m512 g, __m512 u) {
    const __m512 e = exp16_degree(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f)), 5);
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.f)));
    const __m256i silu = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(g, inv));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(silu), 16));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(rounded, u));
}
#endif
#endif

#ifdef __AVX512F__
/* The largest of s[0..len) (len >= 1), 16 lanes at a time, the tail masked. */
static inline float largest_(const float *s, int64_t len) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1);
    vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + t));
    return _mm512_reduce_max_ps(vmax);
}

/* A long sum of float32 terms in 16 lanes, after the terms of x[i..i+16) were added to *lanes: every 1024
 * terms (64 a lane) the lanes are added to the double *sum and cleared (the caller adds what is left at the
 * end). Rows of 151,936 logits summed whole in the lanes drifted 1.4e-5 from the true sum (Zen 4). */
static inline void lanes_into_sum(int64_t i, __m512 *lanes, double *sum) {
    if ((i + 16) % 1024 == 0) {
        *sum += (double)_mm512_reduce_add_ps(*lanes);
        *lanes = _mm512_setzero_ps();
    }
}

/* exp(x - m) for 16 lanes, the argument floored at -200 (e^-200 is 0 in float32 and exp16(-inf) would be
 * NaN): softmax's weight before its division by the sum. */
static inline __m512 softmax_weight16(__m512 x, __m512 m) {
    return exp16(_mm512_max_ps(_mm512_sub_ps(x, m), _mm512_set1_ps(-200.f)));
}
#endif

/* s[t] = exp(s[t] - mx) for t < len, in place, in float32, mx the largest of s: softmax's weights before their
 * division by the sum, which it returns. */
static inline float softmax_weights_(float *s, int64_t len, float mx) {
#ifdef __AVX512F__
    const __m512 m = _mm512_set1_ps(mx);
    const __mmask16 tail = (__mmask16)((1u << (len % 16)) - 1);
    __m512 vsum = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
        const __m512 e = softmax_weight16(_mm512_loadu_ps(s + t), m);
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 e = softmax_weight16(_mm512_maskz_loadu_ps(tail, s + t), m);
    _mm512_mask_storeu_ps(s + t, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    return _mm512_reduce_add_ps(vsum);
#else
    float sum = 0.f;
    _Pragma("omp simd reduction(+:sum)")
    for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
    return sum;
#endif
}

/* s[0..len) = softmax(s[0..len)), in place, in float32. Where stats is not NULL, stats[0] = the largest of s
 * and stats[1] = the sum of exp(s[t] - it) (a part of a longer softmax, merged later). */
static inline void softmax_(float *s, int64_t len, float *stats) {
#ifdef __AVX512F__
    const float mx = largest_(s, len), sum = softmax_weights_(s, len, mx);
    const __mmask16 tail = (__mmask16)((1u << (len % 16)) - 1);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    _mm512_mask_storeu_ps(s + t, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), inv));
#else
    float mx = s[0];
    for (int64_t t = 1; t < len; t++) mx = s[t] > mx ? s[t] : mx;
    const float sum = softmax_weights_(s, len, mx), inv = 1.f / sum;
    _Pragma("omp simd")
    for (int64_t t = 0; t < len; t++) s[t] *= inv;
#endif
    if (stats) stats[0] = mx, stats[1] = sum;
}
