/* Prefill attention's weighted values in pairs of keys, for prefill_attention.c's kernel on
 * AVX512-BF16 CPUs (AMX CPUs multiply the same operands on tiles, attention_amx.c).
 *
 * Each (sequence, KV head)'s values are laid out once in pairs of keys (dim d of values t and t + 1 in one
 * 32-bit word) and each query row's softmax weights, exp(score - the row's largest) before their division by
 * their sum (which scales the row's output instead), rounded to bfloat16 in pairs of keys (as flash
 * attention's are on GPUs), so that one vdpbf16ps multiplies 16 dims x 2 keys: twice the float32 FMA's rate,
 * and no widening of a value row for every query row that reads it, which the decode kernel's float32 loop
 * (weighted_rows) does. Prefill reads each value row for every one of its tokens' query heads, so the layout
 * pays for itself many times over. */
#include <stdint.h>

#include "attention.h"
#include "kernels.h"
#include "vexp.h"

#ifdef ATTENTION_AVX512BF16
/* Dims d .. d + 15 of a bfloat16 row as 32-bit words (0 without a row). */
static inline __m512i widened(const uint16_t *row, int64_t d) {
    return row ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + d))) : _mm512_setzero_si512();
}
#endif

int64_t prefill_pair_words(int64_t ctx, int64_t D) { return (ctx + 31) / 32 * 16 * D; }

void prefill_pair_values(const void **rows, int64_t ctx, int64_t D, int kv_int8, uint16_t *wide, uint32_t *vt) {
#ifdef ATTENTION_AVX512BF16
    const int64_t padded = (ctx + 31) / 32 * 32;
    for (int64_t t = 0; t < padded; t += 2) {
        const uint16_t *a = NULL, *b = NULL;
        if (t < ctx) a = kv_int8 ? (int8_to_bf16(rows[t], wide, D), wide) : rows[t];
        if (t + 1 < ctx) b = kv_int8 ? (int8_to_bf16(rows[t + 1], wide + D, D), wide + D) : rows[t + 1];
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_si512(vt + t / 2 * D + d,
                                _mm512_or_si512(widened(a, d), _mm512_slli_epi32(widened(b, d), 16)));
    }
#else
    (void)rows, (void)ctx, (void)D, (void)kv_int8, (void)wide, (void)vt;
#endif
}

int64_t prefill_pair_softmax(const float *p, const float *v_scales, int64_t rows, int64_t padded, int64_t stride,
                             int64_t first_seen, int64_t G, uint16_t *pbuf, float *inv_sums) {
    const int64_t width = (first_seen + (rows - 1) / G + 31) / 32 * 32; /* the last row sees the most keys */
#ifdef ATTENTION_AVX512BF16
    for (int64_t r = 0; r < padded; r++) {
        const int64_t seen = r < rows ? first_seen + r / G : 0;
        const __m512 m = _mm512_set1_ps(seen ? largest_(p + r * stride, seen) : 0.f);
        __m512 sum = _mm512_setzero_ps();
        const __m512i hi_half = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t t = 0; t < width; t += 32) {
            const __mmask16 ka = valid_keys(t, seen), kb = valid_keys(t + 16, seen);
            __m512 a = _mm512_maskz_mov_ps(ka, softmax_weight16(_mm512_maskz_loadu_ps(ka, p + r * stride + t), m));
            __m512 b = _mm512_maskz_mov_ps(kb, softmax_weight16(_mm512_maskz_loadu_ps(kb, p + r * stride + t + 16), m));
            const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* the weights the values will get */
            sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16)),
                                                   _mm512_castsi512_ps(_mm512_and_si512(rounded, hi_half))));
            if (v_scales) {
                a = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(ka, v_scales + t));
                b = _mm512_mul_ps(b, _mm512_maskz_loadu_ps(kb, v_scales + t + 16));
                _mm512_storeu_si512(pbuf + r * width + t, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            } else {
                _mm512_storeu_si512(pbuf + r * width + t, rounded);
            }
        }
        if (r < rows) inv_sums[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
#else
    (void)p, (void)v_scales, (void)padded, (void)stride, (void)pbuf, (void)inv_sums;
#endif
    return width;
}

#ifdef ATTENTION_AVX512BF16
#define PAIR_ROWS 6 /* query rows whose 64 dims of sums stay in registers: 24 of the 32 */

/* ROWS rows of weights (width bfloat16 apart at w) times `pairs` pairs of keys' 64 dims at v (D words apart),
 * times the row's inv_sums[r], stored at out[r] + d0 in bfloat16. */
static inline __attribute__((always_inline)) void pair_rows(const uint32_t *w, int64_t width, int ROWS,
                                                           const uint32_t *v, int64_t D, int64_t pairs,
                                                           const float *inv_sums, uint16_t *const *out, int64_t d0) {
    __m512 acc[PAIR_ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; k++, v += D) {
        __m512bh x[4];
        for (int i = 0; i < 4; i++) x[i] = (__m512bh)_mm512_loadu_si512(v + 16 * i);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w[r * width / 2 + k]);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], pw, x[i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(out[r] + d0 + 16 * i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][i], _mm512_set1_ps(inv_sums[r]))));
}
#endif

void prefill_values_pairs(const uint16_t *pbuf, int64_t width, const float *inv_sums, int64_t rows,
                          int64_t first_seen, int64_t G, const uint32_t *vts, int64_t D, uint16_t *const *orows) {
#ifdef ATTENTION_AVX512BF16
    for (int64_t r0 = 0; r0 < rows; r0 += PAIR_ROWS) {
        const int64_t n = rows - r0 < PAIR_ROWS ? rows - r0 : PAIR_ROWS;
        const int64_t pairs = (first_seen + (r0 + n - 1) / G + 1) / 2; /* the block's last row sees the most */
        const uint32_t *w = (const uint32_t *)(pbuf + r0 * width);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            switch (n) {
#define PAIR_CASE(c) case c: pair_rows(w, width, c, vts + d0, D, pairs, inv_sums + r0, orows + r0, d0); break;
                PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4) PAIR_CASE(5)
                default: pair_rows(w, width, PAIR_ROWS, vts + d0, D, pairs, inv_sums + r0, orows + r0, d0); break;
#undef PAIR_CASE
            }
        }
    }
#else
    (void)pbuf, (void)width, (void)inv_sums, (void)rows, (void)first_seen, (void)G, (void)vts, (void)D, (void)orows;
#endif
}
