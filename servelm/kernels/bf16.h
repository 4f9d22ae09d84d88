/* bfloat16 <-> float32 for the kernels: a bfloat16 is the top half of a float32. */
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

/* The float32 counterpart of both, for kernels written once for the two dtypes. */
static inline float f32_identity(float f) { return f; }
