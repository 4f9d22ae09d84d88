/* bfloat16 <-> float32 for the kernels (a bfloat16 is the top half of a float32), and float32's bits. */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's conversion does (no NaN inputs here). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to the nearest bfloat16, kept as a float32. */
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* The float32 counterpart of all three, for kernels written once for the two dtypes. */
static inline float f32_identity(float f) { return f; }

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bfloat16 (their bits) widened to 16 float32 lanes. */
static inline __m512 widen16_bits(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline __m512 widen16(const uint16_t *p) { return widen16_bits(_mm256_loadu_si256((const __m256i *)p)); }
#endif

/* Bits tell NaN and infinity apart: -ffast-math lets the compiler assume neither exists. */
static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline int f32_is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }
static inline int f32_is_finite(float f) { return (f32_bits(f) & 0x7f800000u) != 0x7f800000u; }
