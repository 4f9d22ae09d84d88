/* Intel AMX (the tile unit of Sapphire Rapids and later) for the kernels that use it: w8a8_amx.c's int8 GEMM
 * (tdpbssd), gemm_pairs.c's bfloat16 one over the pair layout and attention_amx.c's products (tdpbf16ps).
 * KERNELS_AMX is defined where this build targets AMX-INT8 and AMX-BF16 (-march=native on such a CPU) on
 * Linux. */
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__linux__)
#define KERNELS_AMX 1
#include <immintrin.h>

/* Linux hands out the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once
 * per process: 1 where granted. */
int amx_granted(void);

/* This thread's tiles, all 16 rows of 64 bytes (both kernels' shape: a tile of sums is 16 x 16 32-bit
 * values, a tile of operands 16 rows of 64 int8 or 32 bfloat16). */
void amx_configure(void);

/* Ask for the operand tile (1 KiB in a row) that a weight stream reaches two steps after the one at tile: where
 * the weights come from memory, 1.15-1.31x the bytes per second of both kernels at decoding's rows
 * (docs/BENCHMARKS.md, "Figures behind the code's choices"). */
static inline void amx_prefetch_ahead(const void *tile) {
    for (int line = 0; line < 1024; line += 64) _mm_prefetch((const char *)tile + 2048 + line, _MM_HINT_T0);
}
#endif
