/* The int8 KV cache (--kv-cache-dtype int8): half the bytes of a bfloat16 cache to keep and to read at every
 * decoding step, which at a few dozen sequences reads about as much K/V as weights.
 *
 * Each row (one token's one KV head, attention.h) is rounded on its own: scale = max |x| / 127, each value
 * to the nearest multiple of it. Decoding's scores come from AMX-INT8 tiles where the CPU has them
 * (attention_amx.c, the keys read in place); elsewhere an item's keys are widened to bfloat16 (the integers
 * exactly) into a small staging cache laid out as a bfloat16 cache of 16-token blocks, whose scores
 * paged_attention.c's kernel computes, and the keys' scales then multiply the scores. The values' scales
 * multiply the weights. Prefill reads the int8 cache in paged_attention.c's own kernel. Built at first use
 * by servelm/kernels. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "kernels.h"
#include "vexp.h"

/* dst (D int8, then the float32 scale) = the D values at x (bfloat16 where x_bf16, else float32), rounded. */
static void quantize_row(const void *x, int x_bf16, int64_t D, int8_t *dst) {
#ifdef ATTENTION_AVX512BF16
    if (x_bf16 && D % 16 == 0) { /* the same arithmetic, 16 lanes at a time (prefill writes thousands of rows) */
        const float scale = round_row_int8(x, D, dst);
        memcpy(dst + D, &scale, sizeof scale);
        return;
    }
#endif
    const uint16_t *xb = x;
    const float *xf = x;
    float top = 0.f;
    for (int64_t d = 0; d < D; d++) {
        const float v = fabsf(x_bf16 ? bf16_to_f32(xb[d]) : xf[d]);
        top = v > top ? v : top;
    }
    const float inv = top > 0.f ? 127.f / top : 0.f, scale = top / 127.f;
    for (int64_t d = 0; d < D; d++) dst[d] = (int8_t)lrintf((x_bf16 ? bf16_to_f32(xb[d]) : xf[d]) * inv);
    memcpy(dst + D, &scale, sizeof scale);
}

void write_kv_int8(int8_t *k_cache, int8_t *v_cache, const void *key, const void *value, int x_bf16, int64_t stride,
                   const int64_t *slots, int64_t tokens, int64_t KVH, int64_t D, int nthreads) {
    const int64_t row = kv_row_bytes(D, 1), elem = x_bf16 ? 2 : 4;
    _Pragma("omp parallel for num_threads(nthreads) if (tokens >= 64)")
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t at = (t * stride + h * D) * elem;
            quantize_row((const char *)key + at, x_bf16, D, k_cache + (slots[t] * KVH + h) * row);
            quantize_row((const char *)value + at, x_bf16, D, v_cache + (slots[t] * KVH + h) * row);
        }
}

int kv_int8_decodes(int64_t D) {
#ifdef ATTENTION_AVX512BF16
    return D % 64 == 0;
#else
    (void)D;
    return 0;
#endif
}

#ifdef ATTENTION_AVX512BF16
/* Work items as paged_decode_bf16's: one sequence and a range of its KV heads. */
int paged_decode_int8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads) {
    if (!kv_int8_decodes(D)) return 0;
    const int64_t G = H / KVH, split = B >= nthreads ? 1 : KVH, heads = KVH / split, rows = heads * G;
    const int64_t row = kv_row_bytes(D, 1);
    int64_t longest = 16;
    for (int64_t b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest;
    longest = (longest + 15) / 16 * 16; /* the staged keys: whole 16-token blocks */
    const int64_t items = B * split;
    int64_t claimed = 0; /* items handed out: a thread claims its next one a step ahead */
    _Pragma("omp parallel num_threads(nthreads)") {
        /* one workspace per thread: scores [rows, longest]; the keys' scales [heads, longest] (then the
         * values'); the staged keys [longest, heads, D] bfloat16 and their blocks' table (0, 1, 2, ...); row
         * pointers */
        float *scores = malloc(sizeof(float) * (size_t)((rows + heads) * longest) +
                               sizeof(uint16_t) * (size_t)(longest * heads * D) +
                               sizeof(int64_t) * (size_t)(longest / 16) + sizeof(void *) * (size_t)longest);
        float *k_scales = scores + rows * longest;
        uint16_t *staged = (uint16_t *)(k_scales + heads * longest);
        int64_t *blocks = (int64_t *)(staged + longest * heads * D);
        const void **row_at = (const void **)(blocks + longest / 16);
        for (int64_t i = 0; i < longest / 16; i++) blocks[i] = i;
        int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (next < items) {
            const int64_t item = next, b = item / split, h0 = (item % split) * heads, len = lens[b];
            const int64_t *table = tables + b * max_blocks;
            const uint16_t *qb = q + b * q_stride + h0 * G * D;
            next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            /* As paged_decode_bf16: the values come in while the keys are staged, the next item's keys while
             * the values are summed. */
            struct prefetch_stream values = item_stream(v_cache, item, items, split, heads * row, KVH * row, tables,
                                                        max_blocks, lens, block_size),
                                   keys = item_stream(k_cache, next, items, split, heads * row, KVH * row, tables,
                                                      max_blocks, lens, block_size);
            if (!decode_scores_amx_int8(qb, rows, G, D, k_cache, KVH, h0, table, block_size, len, scale, scores)) {
                row_pointers(k_cache + h0 * row, table, len, block_size, KVH * row, row_at);
                prefetch_rows(row_at, len, heads * row);
                const int64_t per_key = stream_lines_per(&values, len);
                for (int64_t t = 0; t < len; t++) {
                    stream_prefetch(&values, per_key);
                    for (int64_t hh = 0; hh < heads; hh++) {
                        const int8_t *key = (const int8_t *)row_at[t] + hh * row;
                        int8_to_bf16(key, staged + (t * heads + hh) * D, D);
                        k_scales[hh * len + t] = int8_row_scale(key, D);
                    }
                }
                decode_scores_bf16(qb, rows, G, D, staged, heads, 0, blocks, 16, len, scale, scores, row_at, NULL);
                for (int64_t hh = 0; hh < heads; hh++) scale_columns(scores + hh * G * len, G, len, k_scales + hh * len, len);
            }
            for (int64_t r = 0; r < rows; r++) softmax_(scores + r * len, len);
            const int64_t per_row = stream_lines_per(&keys, heads * (D / 64) * ((G + 3) / 4) * len);
            for (int64_t hh = 0; hh < heads; hh++)
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    row_pointers(v_cache + (h0 + hh) * row + d0, table, len, block_size, KVH * row, row_at);
                    prefetch_rows(row_at, len, 64);
                    if (d0 == 0) { /* the values' scales to their weights, once */
                        row_scales(row_at, len, D, k_scales);
                        scale_columns(scores + hh * G * len, G, len, k_scales, len);
                    }
                    for (int64_t r0 = 0; r0 < G; r0 += 4)
                        weighted_heads(scores + (hh * G + r0) * len, len, len, row_at, G - r0 < 4 ? G - r0 : 4, 1,
                                       out + (b * H + (h0 + hh) * G + r0) * D + d0, D, &keys, per_row);
                }
        }
        free(scores);
    }
    return 1;
}
#else
int paged_decode_int8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads) {
    return 0;
}
#endif
