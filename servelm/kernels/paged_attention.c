/* Attention over the paged KV cache, for CPUs.
 *
 * Decode: one query token per sequence reads its keys and values straight
 * from the cache blocks its block table names: no gathered copy, one pass
 * over K and one over V, float32 arithmetic (on AVX512-BF16 CPUs, bfloat16
 * products of q and k summed in float32). Prefill (bfloat16 on AVX512-BF16
 * CPUs only, at the end of this file): tiles of query tokens against their
 * sequence's keys, causally. Built at first use by servelm/kernels.
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
    const int64_t per_chunk = ahead ? stream_lines_per(ahead, len / 16) : 0;
    int64_t t0 = 0;
    for (; t0 + 16 <= len; t0 += 16) {
        stream_prefetch(ahead, per_chunk);
        for (int64_t r = 0; r < rows; r++) {
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
    if (decode_scores_amx(q, rows, G, D, k_cache, KVH, h0, table, block_size, len, scale, scores)) return 1;
    row_pointers(k_cache + h0 * D, table, len, block_size, KVH * D * (int64_t)sizeof(uint16_t), keys);
    prefetch_rows(keys, len, rows / G * D * (int64_t)sizeof(uint16_t)); /* all of the item's heads, first */
    if (D == 64)
        scores_rows(q, rows, G, 64, keys, len, scale, scores, ahead);
    else
        scores_rows(q, rows, G, D, keys, len, scale, scores, ahead);
    return 1;
}

/* out[r] = sum over t of p[r * len + t] * v_t, for the item's rows, rounded to
 * bfloat16; each V row is widened once for all the query heads that read it. v_rows: room for len pointers. */
static int values_bf16(const float *p, int64_t rows, int64_t G, int64_t D, const uint16_t *v_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, uint16_t *out,
                       const void **v_rows, struct prefetch_stream *ahead) {
    if (D % 64) return 0;
    const int64_t per_row = ahead ? stream_lines_per(ahead, rows / G * (D / 64) * ((G + 3) / 4) * len) : 0;
    for (int64_t h = 0; h < rows / G; h++)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            row_pointers(v_cache + (h0 + h) * D + d0, table, len, block_size, KVH * D * (int64_t)sizeof(uint16_t),
                         v_rows);
            prefetch_rows(v_rows, len, 64 * (int64_t)sizeof(uint16_t));
            for (int64_t r0 = 0; r0 < G; r0 += 4) { /* up to 4 query heads x 64 dims: 16 accumulators */
                const float *pr = p + (h * G + r0) * len;
                uint16_t *o = out + (h * G + r0) * D + d0;
                weighted_heads(pr, len, len, v_rows, G - r0 < 4 ? G - r0 : 4, o, D, ahead, per_row);
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
 * A work item is one sequence and a range of its KV heads: all of them when
 * there are at least as many sequences as threads, one otherwise. Within an
 * item the keys (then the values) are read token by token across the item's
 * heads, so each cache block is streamed once, in order; the vector path
 * prefetches the values and the next item's keys while it computes. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, SCORES, VALUES)                                                      \
void NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *tables, int64_t max_blocks, \
          const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, int64_t D,              \
          int64_t block_size, float scale, int nthreads) {                                       \
    const int64_t G = H / KVH;                                                                    \
    const int64_t split = B >= nthreads ? 1 : KVH; /* items per sequence */                      \
    const int64_t heads = KVH / split;             /* KV heads per item */                        \
    const int64_t rows = heads * G;                /* an item's query heads */                    \
    const int64_t row_bytes = KVH * D * (int64_t)sizeof(T), block_bytes = block_size * row_bytes; \
    const int64_t items = B * split, bytes = heads * D * (int64_t)sizeof(T); /* an item's of a row */ \
    int64_t longest = 1, claimed = 0; /* items handed out: a thread claims its next one a step ahead */ \
    for (int64_t b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest;              \
    _Pragma("omp parallel num_threads(nthreads)") {                                               \
    /* one workspace per thread, for its longest item: malloc per item cost more than short items \
     * themselves */                                                                              \
    float *qf = malloc(sizeof(float) * (size_t)(rows * D * 2 + rows * longest) +                  \
                       sizeof(const void *) * (size_t)longest);                                   \
    float *acc = qf + rows * D, *scores = acc + rows * D;                                         \
    const void **row_at = (const void **)(scores + rows * longest);                               \
    int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                             \
    while (next < items) {                                                                        \
        const int64_t item = next, b = item / split, h0 = (item % split) * heads;                 \
        const int64_t len = lens[b];                                                              \
        const int64_t *table = tables + b * max_blocks;                                           \
        next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);                                 \
        /* While the scores are summed, this item's values come into L2, and while the values are, the   \
         * next item's keys (on Zen 5, 32 sequences x 200 tokens from memory took 0.7x the time). */      \
        struct prefetch_stream                                                                    \
            values = item_stream(v_cache, item, items, split, bytes, row_bytes, tables, max_blocks, lens, block_size), \
            keys = item_stream(k_cache, next, items, split, bytes, row_bytes, tables, max_blocks, lens, block_size); \
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
                                    h0 * D * (int64_t)sizeof(T), heads * D * (int64_t)sizeof(T)); \
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
        for (int64_t r = 0; r < rows; r++) softmax_(scores + r * len, len);                      \
        if (!VALUES(scores, rows, G, D, v_cache, KVH, h0, table, block_size, len,                 \
                    out + (b * H + h0 * G) * D, row_at, &keys)) {                                 \
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
    }                                                                                             \
    free(qf);                                                                                     \
    }                                                                                             \
}

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16, decode_scores_bf16, values_bf16)
DEFINE_DECODE(paged_decode_f32, float, f32_identity, f32_identity, scores_none, values_none)

/* Prefill attention over the paged KV cache, bfloat16, for AVX512-BF16 CPUs.
 *
 * Each prefilling sequence s has q_lens[s] new tokens (rows q_starts[s] ..
 * of q and out) at the end of a context of ctx_lens[s] tokens whose K/V are
 * all in the cache already (this step's included); token i of them sees keys
 * 0 .. ctx - q_len + i. PyTorch's CPU path gathers the keys, builds a mask
 * and calls SDPA per sequence, whose per-call and per-head costs dominate
 * prompts of a few hundred tokens; here one call covers every sequence.
 *
 * First each (sequence, KV head)'s keys are transposed, sixteen at a time,
 * to the layout vdpbf16ps multiplies against a broadcast pair of query dims:
 * kt[(c * D / 2 + p) * 16 + j] = dims 2p, 2p+1 of key 16c + j. Then a work
 * item is a tile of tokens (up to 24 query rows) x one KV head's query heads: its
 * scores are summed PREFILL_ROWS query rows at a time against PREFILL_CHUNKS
 * chunks of 16 keys (one load of a key vector serves them all), then each
 * row's softmax weights over the keys it sees (exp(score - the row's
 * largest), rounded to bfloat16) multiply the values, laid out in pairs of
 * keys beside the keys' transposition, and the sums are divided by the
 * weights' sum (attention_pairs.c). On AMX CPUs both products run on tiles
 * (attention_amx.c). An int8 cache (kv_int8, attention.h's rows)
 * has its keys transposed as bfloat16 integers, their scales applied to the
 * scores, and the values' scales to the weights. Returns 0 where it does not
 * apply (the caller then runs PyTorch's path): no AVX512-BF16, or D not a
 * multiple of 64. */
#ifdef ATTENTION_AVX512BF16
#define PREFILL_ROWS 6   /* query rows whose scores stay in registers over a pass of the keys */
#define PREFILL_CHUNKS 4 /* chunks of 16 keys a pass: 24 sums, each key load serving 6 rows, each query load 4 chunks */

static inline __attribute__((always_inline)) void chunk_scores(const uint32_t *kt, const uint32_t *const *q, int ROWS,
                                                              int CHUNKS, int64_t pairs, float scale, float *scores,
                                                              int64_t stride) {
    __m512 acc[PREFILL_ROWS][PREFILL_CHUNKS];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < CHUNKS; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh k[PREFILL_CHUNKS];
        for (int c = 0; c < CHUNKS; c++) k[c] = (__m512bh)_mm512_loadu_si512(kt + (c * pairs + p) * 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q[r][p]);
            for (int c = 0; c < CHUNKS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], qp);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < CHUNKS; c++)
            _mm512_storeu_ps(scores + r * stride + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
}

/* scores[r * stride + 16 * c + j] = scale * q_r . key 16c + j, for rows (1..PREFILL_ROWS) query rows and
 * chunks (1..PREFILL_CHUNKS) chunks of 16 keys. */
static void rows_scores(const uint32_t *kt, const uint32_t *const *q, int64_t rows, int64_t chunks, int64_t pairs,
                        float scale, float *scores, int64_t stride) {
#define ROWS_CASE(n, c) case n: chunk_scores(kt, q, n, c, pairs, scale, scores, stride); break;
#define CHUNK_CASE(c)                                                                                          \
    case c:                                                                                                   \
        switch (rows) {                                                                                       \
            ROWS_CASE(1, c) ROWS_CASE(2, c) ROWS_CASE(3, c) ROWS_CASE(4, c) ROWS_CASE(5, c)                   \
            default: chunk_scores(kt, q, PREFILL_ROWS, c, pairs, scale, scores, stride); break;              \
        }                                                                                                     \
        break;
    switch (chunks) {
        CHUNK_CASE(1) CHUNK_CASE(2) CHUNK_CASE(3)
        default: CHUNK_CASE(PREFILL_CHUNKS)
    }
#undef CHUNK_CASE
#undef ROWS_CASE
}

int paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_int8,
                       const int64_t *tables, int64_t max_blocks, const int64_t *q_starts, const int64_t *q_lens,
                       const int64_t *ctx_lens, int64_t S, uint16_t *out, int64_t H, int64_t KVH, int64_t D,
                       int64_t block_size, float scale, int nthreads) {
    if (D % 64) return 0;
    const int64_t G = H / KVH, pairs = D / 2, row_bytes = kv_row_bytes(D, kv_int8);
    const int64_t tokens = G >= 24 ? 1 : 24 / G; /* a tile's tokens: up to 24 query rows */
    const int amx = decode_scores_use_amx(-1); /* the products on AMX tiles, where they run */
    /* where each (sequence, KV head)'s transposed keys and paired values start, and each sequence's first item */
    int64_t *kt_at = malloc(sizeof(int64_t) * (size_t)(S + 1) * 3), *item_at = kt_at + S + 1, *vt_at = item_at + S + 1;
    kt_at[0] = item_at[0] = vt_at[0] = 0;
    for (int64_t s = 0; s < S; s++) {
        kt_at[s + 1] = kt_at[s] + (ctx_lens[s] + 15) / 16 * 16 * pairs * KVH;
        item_at[s + 1] = item_at[s] + (q_lens[s] + tokens - 1) / tokens * KVH;
        vt_at[s + 1] = vt_at[s] + prefill_pair_words(ctx_lens[s], D) * KVH;
    }
    uint32_t *kt = malloc(sizeof(uint32_t) * (size_t)kt_at[S]);
    uint32_t *vt = malloc(sizeof(uint32_t) * (size_t)vt_at[S]);
    float *k_scales = kv_int8 ? malloc(sizeof(float) * (size_t)(kt_at[S] / pairs)) : NULL; /* per transposed key */
    int64_t longest = 1; /* context */
    for (int64_t s = 0; s < S; s++) longest = ctx_lens[s] > longest ? ctx_lens[s] : longest;
    const int64_t most_rows = (tokens * G + 15) / 16 * 16, widest = (longest + 15) / 16 * 16; /* 16s: AMX tiles */
    const int64_t widest_pairs = (longest + 31) / 32 * 32; /* a row of bfloat16 weights */
    _Pragma("omp parallel num_threads(nthreads)") {
        /* one workspace per thread, for the largest item: a malloc per item cost more than small items */
        float *scores = malloc(sizeof(float) * (size_t)(most_rows * widest + longest + most_rows + 16 * 64) +
                               sizeof(void *) * (size_t)(2 * most_rows + longest) +
                               sizeof(uint16_t) * (size_t)(most_rows * (D + widest_pairs) + 2 * D));
        float *acc = scores + most_rows * widest; /* a pass of AMX sums: 16 rows x 64 dims */
        const uint32_t **qrows = (const uint32_t **)(acc + 16 * 64);
        uint16_t **orows = (uint16_t **)(qrows + most_rows);
        const void **rows_at = (const void **)(orows + most_rows); /* K rows, then V rows */
        uint16_t *qbuf = (uint16_t *)(rows_at + longest); /* the item's query rows, for AMX tiles */
        uint16_t *pbuf = qbuf + most_rows * D;            /* its weights in bfloat16 */
        uint16_t *key_bf16 = pbuf + most_rows * widest_pairs; /* int8 key or value rows widened: two */
        float *v_scales = (float *)(key_bf16 + 2 * D);        /* an int8 head's values' scales */
        float *inv_sums = v_scales + longest;                 /* each row's 1 / its softmax's sum */
        _Pragma("omp for schedule(dynamic)")
        for (int64_t sh = 0; sh < S * KVH; sh++) {
            const int64_t s = sh / KVH, h = sh % KVH, ctx = ctx_lens[s], padded = (ctx + 15) / 16 * 16;
            uint32_t *dst = kt + kt_at[s] + h * padded * pairs;
            const void **keys = rows_at;
            row_pointers((const char *)k_cache + h * row_bytes, tables + s * max_blocks, ctx, block_size,
                         KVH * row_bytes, keys);
            for (int64_t t = 0; t < padded; t++) {
                uint32_t *col = dst + (t / 16) * pairs * 16 + t % 16;
                if (t >= ctx) { /* a stale slot past the context would bring its NaN into the chunk's sums */
                    for (int64_t p = 0; p < pairs; p++) col[p * 16] = 0;
                } else if (kv_int8) { /* the integers, exact in bfloat16; the scale goes to the scores */
                    int8_to_bf16(keys[t], key_bf16, D);
                    const uint32_t *key = (const uint32_t *)key_bf16;
                    for (int64_t p = 0; p < pairs; p++) col[p * 16] = key[p];
                } else {
                    const uint32_t *key = keys[t];
                    for (int64_t p = 0; p < pairs; p++) col[p * 16] = key[p];
                }
                if (kv_int8) k_scales[kt_at[s] / pairs + h * padded + t] = t < ctx ? int8_row_scale(keys[t], D) : 0.f;
            }
            row_pointers((const char *)v_cache + h * row_bytes, tables + s * max_blocks, ctx, block_size,
                         KVH * row_bytes, keys);
            prefill_pair_values(keys, ctx, D, kv_int8, key_bf16, vt + vt_at[s] + h * prefill_pair_words(ctx, D));
        }
        _Pragma("omp for schedule(dynamic)")
        for (int64_t item = 0; item < item_at[S]; item++) {
            int64_t s = 0;
            while (item_at[s + 1] <= item) s++;
            const int64_t h = (item - item_at[s]) % KVH, tile = (item - item_at[s]) / KVH;
            const int64_t ctx = ctx_lens[s], padded = (ctx + 15) / 16 * 16, first = tile * tokens;
            const int64_t n = q_lens[s] - first < tokens ? q_lens[s] - first : tokens, rows = n * G;
            const int64_t pos0 = ctx - q_lens[s] + first; /* the tile's first token's position */
            const int64_t keys = pos0 + n, stride = (keys + 15) / 16 * 16;
            const uint32_t *kts = kt + kt_at[s] + h * padded * pairs;
            const void **v_rows = rows_at;
            for (int64_t r = 0; r < rows; r++) /* row r: token r / G, head h * G + r % G */
                qrows[r] = (const uint32_t *)(q + (q_starts[s] + first + r / G) * q_stride + (h * G + r % G) * D);
            if (!prefill_scores_amx(qrows, rows, D, kts, stride / 16, scale, scores, stride, qbuf))
            for (int64_t c = 0; c < stride / 16; c += PREFILL_CHUNKS)
                for (int64_t r0 = 0; r0 < rows; r0 += PREFILL_ROWS)
                    rows_scores(kts + c * pairs * 16, qrows + r0, rows - r0 < PREFILL_ROWS ? rows - r0 : PREFILL_ROWS,
                                stride / 16 - c < PREFILL_CHUNKS ? stride / 16 - c : PREFILL_CHUNKS, pairs, scale,
                                scores + r0 * stride + c * 16, stride);
            if (kv_int8) scale_columns(scores, rows, stride, k_scales + kt_at[s] / pairs + h * padded, keys);
            if (kv_int8) { /* the values' scales, for their weights */
                row_pointers((const char *)v_cache + h * row_bytes, tables + s * max_blocks, keys, block_size,
                             KVH * row_bytes, v_rows);
                row_scales(v_rows, keys, D, v_scales);
            }
            for (int64_t r = 0; r < rows; r++) orows[r] = out + ((q_starts[s] + first + r / G) * H + h * G + r % G) * D;
            const uint32_t *vts = vt + vt_at[s] + h * prefill_pair_words(ctx, D);
            const int64_t width = prefill_pair_softmax(scores, kv_int8 ? v_scales : NULL, rows,
                                                       amx ? (rows + 15) / 16 * 16 : rows, stride, pos0 + 1, G, pbuf,
                                                       inv_sums);
            if (!(amx && prefill_values_amx(pbuf, width, inv_sums, rows, pos0 + 1, G, vts, D, orows, acc)))
                prefill_values_pairs(pbuf, width, inv_sums, rows, pos0 + 1, G, vts, D, orows);
        }
        free(scores);
    }
    free(kt);
    free(vt);
    free(k_scales);
    free(kt_at);
    return 1;
}
#else
int paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_int8,
                       const int64_t *tables, int64_t max_blocks, const int64_t *q_starts, const int64_t *q_lens,
                       const int64_t *ctx_lens, int64_t S, uint16_t *out, int64_t H, int64_t KVH, int64_t D,
                       int64_t block_size, float scale, int nthreads) {
    return 0;
}
#endif
