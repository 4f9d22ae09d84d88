/* What w8a8.c's GEMM and its AMX path (w8a8_amx.c) share: which path this build has, the padding of K, a
 * row's quantization and the output stage that turns a tile's int32 sums into the layer's outputs. See
 * w8a8.c for the packed weight's layout and the two paths. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vexp.h"

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define W8A8_VNNI 1
#ifdef KERNELS_AMX
#define W8A8_AMX 1
#endif
#endif

/* K is padded to a whole tile row of bytes where AMX may run, to 4 (one vpdpbusd group) elsewhere. */
#ifdef W8A8_AMX
#define K_ALIGN 64
#else
#define K_ALIGN 4
#endif
#define AMX_ROWS 32 /* rows per AMX step: 2 tiles of 16 */
/* Fewer rows stay on VNNI: its 6-row tile reads each weight vector once for them, and AMX's set-up (the tile
 * configuration, a zeroed tile of 16 rows) is no longer paid back (bench/w8a8_gemm.py). */
#define AMX_MIN_ROWS 8

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#ifdef W8A8_VNNI
/* Row m of x (bfloat16 bits or float32) as Kp bytes q + zero_point (the padding: zero_point, a zero), and its
 * scale: q + 128 for vpdpbusd's unsigned side, q itself for tdpbssd. Each 64 bytes of the row go chunk_stride
 * bytes after the last: 64 for a plain row, 1024 for a row of an AMX tile (16 rows x 64 bytes in a row). */
static inline void quantize_row(const void *x, int x_bf16, int64_t m, int64_t K, int64_t Kp, int zero_point,
                                int64_t chunk_stride, uint8_t *q, float *scale) {
    const uint16_t *xb = (const uint16_t *)x + m * K;
    const float *xf = (const float *)x + m * K;
    __m512 amax = _mm512_setzero_ps(), most[4] = {amax, amax, amax, amax};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) /* four at a time, each its own maximum: no mask, no chain through one register */
        for (int j = 0; j < 4; j++) {
            const __m512 v = x_bf16 ? widen16(xb + k + 16 * j) : _mm512_loadu_ps(xf + k + 16 * j);
            most[j] = _mm512_max_ps(most[j], _mm512_abs_ps(v));
        }
    amax = _mm512_max_ps(_mm512_max_ps(most[0], most[1]), _mm512_max_ps(most[2], most[3]));
    for (; k < K; k += 16) {
        const __mmask16 mask = (__mmask16)(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, xb + k)) : _mm512_maskz_loadu_ps(mask, xf + k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    *scale = top / 127.f;
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    const __m512i zp = _mm512_set1_epi32(zero_point);
    /* 64 values at a time: their int32s packed to bytes in registers and stored as one vector (with a masked
     * vpmovdb store per 16, this loop took about a fifth of the kernel's time outside its tiles on Zen 5).
     * Packing interleaves the 128-bit lanes: dword 4 L + p holds part p's values 4 L to 4 L + 3, put back in
     * order by one permute. |q| <= 127, so the packs never saturate, and adding the zero point byte-wise gives
     * q + zero_point mod 256. */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i zp8 = _mm512_set1_epi8((char)zero_point);
    for (k = 0; k + 64 <= K; k += 64) {
        __m512i part[4];
        for (int j = 0; j < 4; j++) {
            const __m512 v = x_bf16 ? widen16(xb + k + 16 * j) : _mm512_loadu_ps(xf + k + 16 * j);
            part[j] = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
        }
        const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(part[0], part[1]), _mm512_packs_epi32(part[2], part[3]));
        _mm512_storeu_si512(q + k / 64 * chunk_stride, _mm512_add_epi8(_mm512_permutexvar_epi32(order, bytes), zp8));
    }
    for (; k < Kp; k += 16) {
        const __mmask16 in = (__mmask16)(K - k >= 16 ? 0xFFFF : K > k ? (1u << (K - k)) - 1 : 0);
        const __mmask16 out = (__mmask16)(Kp - k >= 16 ? 0xFFFF : (1u << (Kp - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(in, xb + k)) : _mm512_maskz_loadu_ps(in, xf + k);
        /* round to nearest even; |v| * inv <= 127, so q + 128 is in [1, 255] */
        const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zp);
        _mm_mask_storeu_epi8(q + k / 64 * chunk_stride + k % 64, out, _mm512_cvtepi32_epi8(qi));
    }
}

/* What one w8a8_gemm call writes its sums into, the same for all its tiles: out = (sums - comp) * row scale *
 * scales[n] + bias[n], rounded to x's dtype (comp NULL: none, the AMX sums). silu: the columns come in pairs
 * of 16-blocks, gate then up (N a multiple of 32), and out [M, N / 2] gets round(silu(gate)) * up of each
 * pair instead, each product rounded to x's dtype first, as a separate silu_mul over the GEMM's output.
 * f32_out: out is float32 whatever x's dtype, holding the values rounded to it. */
struct out_spec {
    const float *row_scales, *scales;
    const int32_t *comp;
    const void *bias;
    int x_bf16, silu, f32_out;
    int64_t N;
    void *out;
};

/* 16 outputs of row m at column n (mask: those before N) from the int32 sums, as float32. */
static inline __m512 scaled16(const int32_t *sums, const struct out_spec *o, int64_t m, int64_t n, __mmask16 mask) {
    const __m512i c = o->comp ? _mm512_loadu_si512(o->comp + n) : _mm512_setzero_si512();
    __m512 bv = _mm512_setzero_ps();
    if (o->bias)
        bv = o->x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)o->bias + n))
                       : _mm512_maskz_loadu_ps(mask, (const float *)o->bias + n);
    const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, o->scales + n), _mm512_set1_ps(o->row_scales[m]));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums), c)), s, bv);
}

/* 16 float32 values rounded to x's dtype, stored at element n of row m (mask: those before the row's end). */
static inline void store16(const struct out_spec *o, int64_t m, int64_t n, int64_t width, __mmask16 mask, __m512 y) {
    if (o->x_bf16 && o->f32_out) {
#ifdef __AVX512BF16__
        y = widen16_bits((__m256i)_mm512_cvtneps_pbh(y));
#else
        float tmp[16];
        _mm512_storeu_ps(tmp, y);
        for (int i = 0; i < 16; i++) tmp[i] = bf16_round(tmp[i]);
        y = _mm512_loadu_ps(tmp);
#endif
        _mm512_mask_storeu_ps((float *)o->out + m * width + n, mask, y);
    } else if (o->x_bf16) {
        uint16_t *dst = (uint16_t *)o->out + m * width + n;
#ifdef __AVX512BF16__
        _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(y));
#else
        float tmp[16];
        _mm512_storeu_ps(tmp, y);
        for (int i = 0; i < 16; i++)
            if (mask >> i & 1) dst[i] = f32_to_bf16(tmp[i]);
#endif
    } else {
        _mm512_mask_storeu_ps((float *)o->out + m * width + n, mask, y);
    }
}

/* round(silu(round(g))) * round(u), rounded, for 16 lanes: silu_mul over the rounded GEMM outputs. */
static inline void store_silu16(const struct out_spec *o, int64_t m, int64_t n, __m512 g, __m512 u) {
    const int64_t width = o->N / 2;
#ifdef __AVX512BF16__
    if (o->x_bf16 && !o->f32_out) {
        const __m512 gr = widen16_bits((__m256i)_mm512_cvtneps_pbh(g)), ur = widen16_bits((__m256i)_mm512_cvtneps_pbh(u));
        _mm256_storeu_si256((__m256i *)((uint16_t *)o->out + m * width + n), silu_mul16_bf16(gr, ur));
        return;
    }
#endif
    float gs[16], us[16], y[16];
    _mm512_storeu_ps(gs, g);
    _mm512_storeu_ps(us, u);
    for (int i = 0; i < 16; i++) {
        const float gi = o->x_bf16 ? bf16_round(gs[i]) : gs[i];
        const float ui = o->x_bf16 ? bf16_round(us[i]) : us[i];
        const float si = o->x_bf16 ? bf16_round(silu(gi)) : silu(gi);
        y[i] = si * ui;
    }
    store16(o, m, n, width, 0xFFFF, _mm512_loadu_ps(y));
}

/* Rows m to m + rows of the outputs at columns n0 to n0 + cols (masked past N) from their sums, sums[r][j]. */
static inline void scale_out(int32_t (*sums)[64], int rows, int64_t cols, int64_t m, int64_t n0,
                             const struct out_spec *o) {
    if (o->silu) {
        for (int64_t j = 0; j < cols; j += 32)
            for (int r = 0; r < rows; r++)
                store_silu16(o, m + r, (n0 + j) / 2, scaled16(sums[r] + j, o, m + r, n0 + j, 0xFFFF),
                             scaled16(sums[r] + j + 16, o, m + r, n0 + j + 16, 0xFFFF));
        return;
    }
    for (int64_t j = 0; j < cols; j += 16) {
        const int64_t n = n0 + j;
        const __mmask16 mask = (__mmask16)(o->N - n >= 16 ? 0xFFFF : (1u << (o->N - n)) - 1);
        for (int r = 0; r < rows; r++) store16(o, m + r, n, o->N, mask, scaled16(sums[r] + j, o, m + r, n, mask));
    }
}

#ifdef W8A8_AMX
/* w8a8_gemm on the tile unit (w8a8_amx.c), for M >= AMX_MIN_ROWS where w8a8_use_amx allows. */
void w8a8_amx_gemm(const void *x, int64_t M, int64_t K, const int8_t *packed, struct out_spec o, int nthreads);
#endif
#endif
