/* Decode attention over the paged KV cache, for CPUs.
 *
 * One query token per sequence reads its keys and values straight from the
 * cache blocks its block table names: no gathered copy, one pass over K and
 * one over V, float32 arithmetic (on AVX512-BF16 CPUs, bfloat16 products of
 * q and k summed in float32). Built at first use by servelm/kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ATTENTION_AVX512BF16 1 /* bf16.h brings immintrin.h */
#endif

/* Blocks are scattered through the cache, where the hardware prefetcher cannot
 * follow; on entering block i of a table, ask for block i + 1. */
static inline void prefetch_next_block(const int64_t *table, int64_t t, int64_t len, int64_t block_size,
                                       const char *base, int64_t block_bytes, int64_t offset, int64_t bytes) {
    if (t % block_size != 0 || (t / block_size + 1) * block_size >= len) return; /* no next block */
    const char *next = base + table[t / block_size + 1] * block_bytes;
    for (int64_t i = 0; i < block_size; i++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(next + i * (block_bytes / block_size) + offset + o);
}

/* On AVX512-BF16 CPUs the bfloat16 kernel's two passes have vector versions
 * (below), each returning 0 where it does not apply so that the portable loop
 * runs instead. The portable loops spend most of their instructions on a
 * horizontal sum per key and query head, on widening each K/V row once per
 * query head that reads it, and on loading and storing the float32
 * accumulators for every key; these do none of that, and ask for an item's
 * K rows (then each head's V rows) all at once before reading them: 1.7-1.9x
 * faster per layer (bench/kernels.py), 22 -> 14 ms of a 32-sequence step. */
#ifdef ATTENTION_AVX512BF16
/* Lane j of the result: the sum of v[j]'s 16 lanes (a transposing add tree,
 * 15 adds instead of 16 separate horizontal sums). */
static inline __m512 lane_sums16(const __m512 v[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: two partial sums each of v2i, v2i+1 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: one partial sum each of v4i .. v4i+3 */
        __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1 and 2+3 */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* 16 lanes of a . b over D bfloat16 (D a multiple of 32), by vdpbf16ps: exact products, float32 sums. */
static inline __m512 dot_bf16(const uint16_t *a, const uint16_t *b, int64_t D) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    return s;
}

/* acc (ROWS query heads x 64 dims, in registers) = sum over t of p[r][t] * v_t, for the 64 dims at v_rows[t]. */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, int64_t len, const uint16_t **v_rows,
                                                               int ROWS, uint16_t *out, int64_t out_stride) {
    __m512 acc[4][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        __m512 v[4];
        for (int i = 0; i < 4; i++) v[i] = widen16(v_rows[t] + 16 * i);
        for (int r = 0; r < ROWS; r++) {
            const __m512 w = _mm512_set1_ps(p[r * len + t]);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_fmadd_ps(w, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * i), (__m256i)_mm512_cvtneps_pbh(acc[r][i]));
}

/* scores[r * len + t] = scale * (q_r . k_t) for the item's rows r (query
 * heads, contiguous at q) against its KV heads from h0, sixteen keys at a time. */
static int scores_bf16(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const uint16_t *k_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                       float *scores) {
    if (D % 32) return 0;
    const int64_t bytes = rows / G * D * (int64_t)sizeof(uint16_t); /* of the item's heads in a K row */
    for (int64_t t = 0; t < len; t++) { /* all of them into L2 first: blocks are scattered */
        const char *key = (const char *)(k_cache + ((table[t / block_size] * block_size + t % block_size) * KVH + h0) * D);
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(key + o, _MM_HINT_T1);
    }
    int64_t t0 = 0;
    for (; t0 + 16 <= len; t0 += 16) {
        const uint16_t *keys[16];
        for (int j = 0; j < 16; j++) {
            const int64_t t = t0 + j, slot = table[t / block_size] * block_size + t % block_size;
            keys[j] = k_cache + (slot * KVH + h0) * D;
        }
        for (int64_t r = 0; r < rows; r++) {
            __m512 parts[16];
            for (int j = 0; j < 16; j++) parts[j] = dot_bf16(q + r * D, keys[j] + (r / G) * D, D);
            _mm512_storeu_ps(scores + r * len + t0, _mm512_mul_ps(lane_sums16(parts), _mm512_set1_ps(scale)));
        }
    }
    for (; t0 < len; t0++) {
        const int64_t slot = table[t0 / block_size] * block_size + t0 % block_size;
        const uint16_t *key = k_cache + (slot * KVH + h0) * D;
        for (int64_t r = 0; r < rows; r++)
            scores[r * len + t0] = scale * _mm512_reduce_add_ps(dot_bf16(q + r * D, key + (r / G) * D, D));
    }
    return 1;
}

/* out[r] = sum over t of p[r * len + t] * v_t, for the item's rows, rounded to
 * bfloat16; each V row is widened once for all the query heads that read it. */
static int values_bf16(const float *p, int64_t rows, int64_t G, int64_t D, const uint16_t *v_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, uint16_t *out) {
    if (D % 64) return 0;
    const uint16_t **v_rows = malloc(sizeof(*v_rows) * (size_t)len);
    for (int64_t h = 0; h < rows / G; h++)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            for (int64_t t = 0; t < len; t++) {
                v_rows[t] = v_cache + ((table[t / block_size] * block_size + t % block_size) * KVH + h0 + h) * D + d0;
                _mm_prefetch((const char *)v_rows[t], _MM_HINT_T1);
                _mm_prefetch((const char *)(v_rows[t] + 32), _MM_HINT_T1);
            }
            for (int64_t r0 = 0; r0 < G; r0 += 4) { /* up to 4 query heads x 64 dims: 16 accumulators */
                const float *pr = p + (h * G + r0) * len;
                uint16_t *o = out + (h * G + r0) * D + d0;
                switch (G - r0 < 4 ? G - r0 : 4) {
                    case 1: weighted_rows(pr, len, v_rows, 1, o, D); break;
                    case 2: weighted_rows(pr, len, v_rows, 2, o, D); break;
                    case 3: weighted_rows(pr, len, v_rows, 3, o, D); break;
                    default: weighted_rows(pr, len, v_rows, 4, o, D); break;
                }
            }
        }
    free(v_rows);
    return 1;
}

#else
#define scores_bf16(...) 0
#define values_bf16(...) 0
#endif

/* The float32 kernel has none. */
#define scores_none(...) 0
#define values_none(...) 0

/* q: [B, H, D], token b's heads at q + b * q_stride; k_cache, v_cache: [num_blocks, block_size, KVH, D];
 * tables: [B, max_blocks]; lens: [B] (keys each sequence attends to, >= 1);
 * out: [B, H, D]. Query head h reads KV head h / (H / KVH).
 *
 * A work item is one sequence and a range of its KV heads: all of them when
 * there are at least as many sequences as threads, one otherwise. Within an
 * item the keys (then the values) are read token by token across the item's
 * heads, so each cache block is streamed once, in order. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, SCORES, VALUES)                                                      \
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
        if (!SCORES(q + b * q_stride + h0 * G * D, rows, G, D, k_cache, KVH, h0, table, block_size, len,\
                    scale, scores))                                                                \
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
        if (!VALUES(scores, rows, G, D, v_cache, KVH, h0, table, block_size, len,                 \
                    out + (b * H + h0 * G) * D)) {                                                \
            memset(acc, 0, sizeof(float) * (size_t)(rows * D));                                   \
            for (int64_t t = 0; t < len; t++) {                                                   \
                const int64_t slot = table[t / block_size] * block_size + t % block_size;         \
                prefetch_next_block(table, t, len, block_size, (const char *)v_cache, block_bytes,\
                                    h0 * D * (int64_t)sizeof(T), heads * D * (int64_t)sizeof(T)); \
                const T *vp = v_cache + (slot * KVH + h0) * D;                                    \
                for (int64_t r = 0; r < rows; r++) {                                              \
                    const T *vr = vp + (r / G) * D;                                               \
                    const float p = scores[r * len + t];                                          \
                    float *ar = acc + r * D;                                                      \
                    _Pragma("omp simd")                                                           \
                    for (int64_t d = 0; d < D; d++) ar[d] += p * LOAD(vr[d]);                     \
                }                                                                                 \
            }                                                                                     \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                T *op = out + (b * H + h0 * G + r) * D;                                           \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < D; d++) op[d] = STORE(acc[r * D + d]);                    \
            }                                                                                     \
        }                                                                                         \
        free(qf);                                                                                 \
    }                                                                                             \
}

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, scores_bf16, values_bf16)
DEFINE_DECODE(paged_decode_f32, float, f32_identity, f32_identity, scores_none, values_none)
