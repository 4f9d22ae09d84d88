/* Decoding's attention over the paged KV cache, for CPUs: one query token
 * per sequence reads its keys and values straight from the cache blocks its
 * block table names: no gathered copy, one pass over K and one over V,
 * float32 arithmetic (on AVX512-BF16 CPUs, bfloat16 products of q and k
 * summed in float32). Prefill's is in prefill_attention.c. Built at first
 * use by servelm/kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "attention.h"
#include "kernels.h"
#include "vexp.h"

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
 * K rows (then each head's V rows) all at once before reading them
 * (bench/kernels.py measures both). */
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
static inline __attribute__((always_inline)) __m512 dot_bf16(const uint16_t *a, const uint16_t *b, int64_t D) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    return s;
}

/* scores[r * len + t] = scale * (q_r . k_t) for rows query heads (contiguous at q) against the keys at
 * keys[t] (the item's first KV head; query head r reads KV head r / G), sixteen keys at a time. D is a
 * constant where this is inlined for 64-dim heads. */
static inline __attribute__((always_inline)) void scores_rows(const uint16_t *q, int64_t rows, int64_t G, int64_t D,
                                                             const void **keys, int64_t len, float scale,
                                                             float *scores, struct prefetch_stream *ahead) {
    const int64_t per_row = ahead ? stream_lines_per(ahead, len / 16 * rows) : 0;
    int64_t t0 = 0;
    for (; t0 + 16 <= len; t0 += 16) {
        for (int64_t r = 0; r < rows; r++) {
            stream_prefetch(ahead, per_row);
            __m512 parts[16];
            for (int j = 0; j < 16; j++) parts[j] = dot_bf16(q + r * D, (const uint16_t *)keys[t0 + j] + (r / G) * D, D);
            _mm512_storeu_ps(scores + r * len + t0, _mm512_mul_ps(lane_sums16(parts), _mm512_set1_ps(scale)));
        }
    }
    for (; t0 < len; t0++)
        for (int64_t r = 0; r < rows; r++)
            scores[r * len + t0] = scale * _mm512_reduce_add_ps(dot_bf16(q + r * D, (const uint16_t *)keys[t0] + (r / G) * D, D));
}

/* The item's scores: its query heads (contiguous at q) against its KV heads from h0 (attention.h). */
int decode_scores_bf16(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const uint16_t *k_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                       float *scores, const void **keys, struct prefetch_stream *ahead) {
    if (D % 32) return 0;
    if (decode_scores_amx(q, rows, G, D, k_cache, KVH, h0, table, block_size, len, scale, scores, ahead)) return 1;
    row_pointers(k_cache + h0 * D, table, len, block_size, KVH * D * (int64_t)sizeof(uint16_t), keys);
    prefetch_rows(keys, len, rows / G * D * (int64_t)sizeof(uint16_t)); /* all of the item's heads, first */
    if (D == 64)
        scores_rows(q, rows, G, 64, keys, len, scale, scores, ahead);
    else
        scores_rows(q, rows, G, D, keys, len, scale, scores, ahead);
    return 1;
}

/* out[r] = sum over t of p[r * len + t] * v_t, for the item's rows, rounded to
 * bfloat16 (or in float32 at part[r], where part is not NULL); each V row is widened once for all the query
 * heads that read it. v_rows: room for len pointers. */
static int values_bf16(const float *p, int64_t rows, int64_t G, int64_t D, const uint16_t *v_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, uint16_t *out,
                       float *part, const void **v_rows, struct prefetch_stream *ahead) {
    if (D % 64) return 0;
    const int64_t per_row = ahead ? stream_lines_per(ahead, rows / G * (D / 64) * ((G + 3) / 4) * len) : 0;
    for (int64_t h = 0; h < rows / G; h++)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            row_pointers(v_cache + (h0 + h) * D + d0, table, len, block_size, KVH * D * (int64_t)sizeof(uint16_t),
                         v_rows);
            prefetch_rows(v_rows, len, 64 * (int64_t)sizeof(uint16_t));
            for (int64_t r0 = 0; r0 < G; r0 += 4) { /* up to 4 query heads x 64 dims: 16 accumulators */
                const float *pr = p + (h * G + r0) * len;
                const int64_t at = (h * G + r0) * D + d0;
                weighted_heads(pr, len, len, v_rows, G - r0 < 4 ? G - r0 : 4, out + at, part ? part + at : NULL, D,
                               ahead, per_row);
            }
        }
    return 1;
}

#else
#define decode_scores_bf16(...) 0
#define values_bf16(...) 0
#endif

/* The float32 kernel has none. */
#define scores_none(...) 0
#define values_none(...) 0

/* q: [B, H, D], token b's heads at q + b * q_stride; k_cache, v_cache: [num_blocks, block_size, KVH, D];
 * tables: [B, max_blocks]; lens: [B] (keys each sequence attends to, >= 1);
 * out: [B, H, D]. Query head h reads KV head h / (H / KVH).
 *
 * A work item is one sequence and a range of its KV heads (all of them when
 * there are at least as many sequences as threads, one otherwise) over its
 * keys, or over a part of them for a long sequence (decode_plan.c). Within an
 * item the keys (then the values) are read token by token across the item's
 * heads, so each cache block is streamed once, in order; the vector path
 * prefetches the values and the next item's keys while it computes. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, SCORES, VALUES)                                                      \
void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *tables, int64_t max_blocks, \
          const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, int64_t D,              \
          int64_t block_size, float scale, int nthreads) {                                       \
    const int64_t G = H / KVH;                                                                    \
    const int64_t split = B >= nthreads ? 1 : KVH; /* items per sequence (or part) */            \
    const int64_t heads = KVH / split;             /* KV heads per item */                        \
    const int64_t rows = heads * G;                /* an item's query heads */                    \
    const int64_t head_bytes = D * (int64_t)sizeof(T), row_bytes = KVH * head_bytes;              \
    const int64_t block_bytes = block_size * row_bytes;                                           \
    struct decode_plan plan = decode_plan(lens, B, split, heads, rows, D, block_size);            \
    const int64_t longest = plan.longest;                                                         \
    int64_t claimed = 0; /* items handed out: a thread claims its next one a step ahead */        \
    _Pragma("omp parallel num_threads(nthreads)") {                                               \
    /* one workspace per thread, for its longest item: malloc per item cost more than short items \
     * themselves */                                                                              \
    float *qf = malloc(sizeof(float) * (size_t)(rows * D * 2 + rows * longest) +                  \
                       sizeof(const void *) * (size_t)longest);                                   \
    float *acc = qf + rows * D, *scores = acc + rows * D;                                         \
    const void **row_at = (const void **)(scores + rows * longest);                               \
    int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                             \
    while (next < plan.count) {                                                                   \
        const int64_t item = next, b = plan.items[item].b, h0 = plan.items[item].h0;              \
        const int64_t len = plan.items[item].len;                                                 \
        const int64_t *table = tables + b * max_blocks + plan.items[item].first / block_size;     \
        float *part = decode_part(&plan, item); /* float32 sums for the merge, or NULL: rows to out */ \
        next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                                 \
        /* While the scores are summed, this item's values come into L2, and while the values are, the   \
         * next item's keys (on Zen 5, 32 sequences x 200 tokens from memory took 0.7x the time). */      \
        struct prefetch_stream                                                                    \
            values = decode_item_stream(&plan, item, v_cache, head_bytes, heads, row_bytes, tables, max_blocks, block_size), \
            keys = decode_item_stream(&plan, next, k_cache, head_bytes, heads, row_bytes, tables, max_blocks, block_size); \
        /* rows = the item's query heads, h0 * G .. (h0 + heads) * G - 1 */                       \
        if (!SCORES(q + b * q_stride + h0 * G * D, rows, G, D, k_cache, KVH, h0, table, block_size, len,\
                    scale, scores, row_at, &values)) {                                             \
            for (int64_t r = 0; r < rows; r++) {                                                  \
                const T *qp = q + b * q_stride + (h0 * G + r) * D;                                \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < D; d++) qf[r * D + d] = LOAD(qp[d]) * scale;              \
            }                                                                                     \
            for (int64_t t = 0; t < len; t++) {                                                   \
                const int64_t slot = table[t / block_size] * block_size + t % block_size;         \
                prefetch_next_block(table, t, len, block_size, (const char *)k_cache, block_bytes, \
                                    h0 * head_bytes, heads * head_bytes);                         \
                const T *kp = k_cache + (slot * KVH + h0) * D;                                    \
                for (int64_t r = 0; r < rows; r++) {                                              \
                    const T *kr = kp + (r / G) * D;                                               \
                    float s = 0.f;                                                                \
                    _Pragma("omp simd reduction(+:s)")                                            \
                    for (int64_t d = 0; d < D; d++) s += qf[r * D + d] * LOAD(kr[d]);             \
                    scores[r * len + t] = s;                                                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                        \
            softmax_(scores + r * len, len, part ? part + rows * D + 2 * r : NULL);               \
        if (!VALUES(scores, rows, G, D, v_cache, KVH, h0, table, block_size, len,                 \
                    out + (b * H + h0 * G) * D, part, row_at, &keys)) {                           \
            memset(acc, 0, sizeof(float) * (size_t)(rows * D));                                   \
            for (int64_t t = 0; t < len; t++) {                                                   \
                const int64_t slot = table[t / block_size] * block_size + t % block_size;         \
                prefetch_next_block(table, t, len, block_size, (const char *)v_cache, block_bytes,\
                                    h0 * head_bytes, heads * head_bytes);                         \
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
                for (int64_t d = 0; d < D; d++) {                                                 \
                    if (part) part[r * D + d] = acc[r * D + d];                                   \
                    else op[d] = STORE(acc[r * D + d]);                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        decode_item_done(&plan, item, H, G, out, sizeof(T) == 2);                                 \
    }                                                                                             \
    free(qf);                                                                                     \
    }                                                                                             \
    decode_plan_free(&plan);                                                \
}

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, decode_scores_bf16, values_bf16)
DEFINE_DECODE(paged_decode_f32, float, f32_identity, f32_identity, scores_none, values_none)
