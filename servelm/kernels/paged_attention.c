/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence reads its keys and values straight from the
 * cache blocks its block table names: no gathered copy, one pass over K and
 * one over V, float32 arithmetic. Built at first use by servelm/kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

/* Blocks are scattered through the cache, where the hardware prefetcher cannot
 * follow; on entering block i of a table, ask for block i + 1. */
static inline void prefetch_next_block(const int64_t *table, int64_t t, int64_t len, int64_t block_size,
                                       const char *base, int64_t block_bytes, int64_t offset, int64_t bytes) {
    if (t % block_size != 0 || (t / block_size + 1) * block_size >= len) return; /* no next block */
    const char *next = base + table[t / block_size + 1] * block_bytes;
    for (int64_t i = 0; i < block_size; i++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(next + i * (block_bytes / block_size) + offset + o);
}

/* q: [B, H, D], token b's heads at q + b * q_stride; k_cache, v_cache: [num_blocks, block_size, KVH, D];
 * tables: [B, max_blocks]; lens: [B] (keys each sequence attends to, >= 1);
 * out: [B, H, D]. Query head h reads KV head h / (H / KVH).
 *
 * A work item is one sequence and a range of its KV heads: all of them when
 * there are at least as many sequences as threads, one otherwise. Within an
 * item the keys (then the values) are read token by token across the item's
 * heads, so each cache block is streamed once, in order. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                        \
void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *tables, int64_t max_blocks, \
          const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, int64_t D,              \
          int64_t block_size, float scale, int nthreads) {                                       \
    const int64_t G = H / KVH;                                                                    \
    const int64_t split = B >= nthreads ? 1 : KVH; /* items per sequence */                      \
    const int64_t heads = KVH / split;             /* KV heads per item */                        \
    const int64_t block_bytes = block_size * KVH * D * (int64_t)sizeof(T);                        \
    _Pragma("omp parallel for schedule(dynamic) num_threads(nthreads)")                           \
    for (int64_t item = 0; item < B * split; item++) {                                            \
        const int64_t b = item / split, h0 = (item % split) * heads, rows = heads * G;            \
        const int64_t len = lens[b];                                                              \
        const int64_t *table = tables + b * max_blocks;                                           \
        /* rows = the item's query heads, h0 * G .. (h0 + heads) * G - 1 */                       \
        float *qf = malloc(sizeof(float) * (size_t)(rows * D * 2 + rows * len));                  \
        float *acc = qf + rows * D, *scores = acc + rows * D;                                     \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *qp = q + b * q_stride + (h0 * G + r) * D;                                    \
            _Pragma("omp simd")                                                                   \
            for (int64_t d = 0; d < D; d++) qf[r * D + d] = LOAD(qp[d]) * scale;                  \
        }                                                                                         \
        for (int64_t t = 0; t < len; t++) {                                                       \
            const int64_t slot = table[t / block_size] * block_size + t % block_size;             \
            prefetch_next_block(table, t, len, block_size, (const char *)k_cache, block_bytes,     \
                                h0 * D * (int64_t)sizeof(T), heads * D * (int64_t)sizeof(T));     \
            const T *kp = k_cache + (slot * KVH + h0) * D;                                        \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                const T *kr = kp + (r / G) * D;                                                   \
                float s = 0.f;                                                                    \
                _Pragma("omp simd reduction(+:s)")                                                \
                for (int64_t d = 0; d < D; d++) s += qf[r * D + d] * LOAD(kr[d]);                 \
                scores[r * len + t] = s;                                                          \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float *sr = scores + r * len, mx = sr[0], sum = 0.f;                                  \
            for (int64_t t = 1; t < len; t++) mx = sr[t] > mx ? sr[t] : mx;                       \
            _Pragma("omp simd reduction(+:sum)")                                                  \
            for (int64_t t = 0; t < len; t++) { sr[t] = expf(sr[t] - mx); sum += sr[t]; }         \
            const float inv = 1.f / sum;                                                          \
            _Pragma("omp simd")                                                                   \
            for (int64_t t = 0; t < len; t++) sr[t] *= inv;                                       \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * (size_t)(rows * D));                                       \
        for (int64_t t = 0; t < len; t++) {                                                       \
            const int64_t slot = table[t / block_size] * block_size + t % block_size;             \
            prefetch_next_block(table, t, len, block_size, (const char *)v_cache, block_bytes,     \
                                h0 * D * (int64_t)sizeof(T), heads * D * (int64_t)sizeof(T));     \
            const T *vp = v_cache + (slot * KVH + h0) * D;                                        \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                const T *vr = vp + (r / G) * D;                                                   \
                const float p = scores[r * len + t];                                              \
                float *ar = acc + r * D;                                                          \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < D; d++) ar[d] += p * LOAD(vr[d]);                         \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            T *op = out + (b * H + h0 * G + r) * D;                                               \
            _Pragma("omp simd")                                                                   \
            for (int64_t d = 0; d < D; d++) op[d] = STORE(acc[r * D + d]);                        \
        }                                                                                         \
        free(qf);                                                                                 \
    }                                                                                             \
}

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_DECODE(paged_decode_f32, float, f32_identity, f32_identity)
