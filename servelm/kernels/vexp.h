/* exp over 16 float32 lanes, for the kernels' softmaxes and SiLU: libmvec's expf, which GCC calls from
 * vectorized loops, cost several times more. */
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) to about an ulp, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in
 * two parts, so that r stays exact), e^r by its Taylor series to r^7, times
 * 2^n (vscalefps: overflow to inf and underflow to 0 as expf does). */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    static const float coefficients[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    for (int i = 0; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficients[i]));
    return _mm512_scalef_ps(p, n);
}
#endif
