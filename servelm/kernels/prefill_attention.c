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
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"
#include "kernels.h"
#include "vexp.h"

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
