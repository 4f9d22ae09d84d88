/* What the attention kernels share: paged_attention.c (decode over bfloat16 and float32 caches),
 * prefill_attention.c and kv_int8.c (the int8 cache).
 *
 * A row is one token's one KV head in the cache. In a bfloat16 cache it is D bfloat16; in an int8 cache
 * (--kv-cache-dtype int8) D int8 values and then their float32 scale, D + 4 bytes: value d is
 * row[d] * scale. The kernels multiply the int8 values as integers (decoding, kv_int8.c) or as bfloat16, in
 * which integers of int8's range are exact (prefill), and apply the scales to the sums: a key's scale to its
 * scores, a value's to its weights. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KV_INT8_SCALE_BYTES 4

/* Bytes of a row of D values: int8 (with its scale) or bfloat16. */
static inline int64_t kv_row_bytes(int64_t D, int int8) { return int8 ? D + KV_INT8_SCALE_BYTES : 2 * D; }

/* The scale of the int8 row at row (D values). */
static inline float int8_row_scale(const void *row, int64_t D) {
    float s;
    memcpy(&s, (const char *)row + D, sizeof s);
    return s;
}

/* rows[t] = base + (token t's cache slot) * row_bytes for t < len, walking the table's blocks in order (a
 * division per token cost as much as the arithmetic it fed). */
static inline void row_pointers(const void *base, const int64_t *table, int64_t len, int64_t block_size,
                                int64_t row_bytes, const void **rows) {
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const char *block = (const char *)base + table[b] * block_size * row_bytes;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++) rows[t0 + i] = block + i * row_bytes;
    }
}

/* Prefetches into L2 over the first `bytes` of rows 0..len of one item's part of the cache (row t at base +
 * (token t's slot) * row_bytes), handed out a few lines at a time between a kernel's steps, so that memory
 * keeps busy while the core computes instead of the two taking turns. */
struct prefetch_stream {
    const char *base;
    const int64_t *table;
    int64_t block_size, row_bytes, bytes, len;
    int64_t t, block, in_block, offset; /* the next line: row t (the table's block-th, its in_block-th), at offset */
};

static inline struct prefetch_stream prefetch_stream(const void *base, const int64_t *table, int64_t block_size,
                                                     int64_t row_bytes, int64_t bytes, int64_t len) {
    if (bytes == row_bytes && len > 0) { /* whole rows: each block is one run of lines, walked as one row */
        row_bytes *= block_size, bytes = row_bytes, len = (len + block_size - 1) / block_size, block_size = 1;
    }
    return (struct prefetch_stream){(const char *)base, table, block_size, row_bytes, bytes, len, 0, 0, 0, 0};
}

/* The stream's lines, and how many of them each of `steps` steps asks for to have them all asked for. */
static inline int64_t stream_lines_per(const struct prefetch_stream *s, int64_t steps) {
    const int64_t lines = s->len * ((s->bytes + 63) / 64);
    return steps > 0 ? (lines + steps - 1) / steps : lines;
}

/* The next n lines of s (none once it is done, or where s is NULL). */
static inline void stream_prefetch(struct prefetch_stream *s, int64_t n) {
    if (!s || n <= 0 || s->t >= s->len) return;
    int64_t t = s->t, block = s->block, in_block = s->in_block, offset = s->offset; /* in registers, not */
    const int64_t len = s->len, bytes = s->bytes, block_size = s->block_size;      /* stored each line */
    const char *row = s->base + (s->table[block] * block_size + in_block) * s->row_bytes;
    for (; n > 0 && t < len; n--) { /* walking the table: no division a line */
        __builtin_prefetch(row + offset, 0, 2); /* prefetcht1: into L2 */
        if ((offset += 64) < bytes) continue;
        offset = 0, t++;
        if (++in_block == block_size) in_block = 0, block++;
        if (t < len) row = s->base + (s->table[block] * block_size + in_block) * s->row_bytes;
    }
    s->t = t, s->block = block, s->in_block = in_block, s->offset = offset;
}

/* decode_plan.c: decoding's work items, one sequence's KV heads h0 .. over its keys first .. first + len - 1
 * (first a multiple of the block size); a sequence of parts > 1 items (from item `group` on) sums each part's
 * rows into float32 partials, merged when the last is done (decode_item_done). */
struct decode_item {
    int64_t b, h0, first, len, parts, group;
};

struct decode_plan {
    struct decode_item *items; /* each sequence's in turn, its parts side by side */
    int64_t *done;             /* per group, where some sequence has parts: its parts summed so far */
    int64_t count, longest;    /* items; the most keys of any */
    int64_t rows, D;           /* an item's query heads; their dims */
    float *partials;           /* per item, where some sequence has parts: rows x D sums, then rows x (largest, sum) */
};

/* The items of B sequences of lens[b] keys, each split into `split` items of `heads` KV heads (rows query
 * heads of D dims). */
struct decode_plan decode_plan(const int64_t *lens, int64_t B, int64_t split, int64_t heads, int64_t rows,
                               int64_t D, int64_t block_size);
void decode_plan_free(struct decode_plan *plan);
/* Item i's partials (rows x D float32 sums, each row normalized by its part's softmax, then the rows' softmax
 * stats as softmax_ leaves them), or NULL where it writes its rows to the output itself. */
float *decode_part(const struct decode_plan *plan, int64_t i);
/* Item i's share of a cache (rows of row_bytes, KV heads of head_bytes in them) as a prefetch stream; empty
 * past the last item. */
struct prefetch_stream decode_item_stream(const struct decode_plan *plan, int64_t i, const void *cache,
                                          int64_t head_bytes, int64_t heads, int64_t row_bytes,
                                          const int64_t *tables, int64_t max_blocks, int64_t block_size);
/* After item i (its partials written, where it has them): where it was its sequence's last part to finish,
 * that sequence's rows, its parts weighed by their softmax stats, into out [B, H, D] (bfloat16 where
 * out_bf16, else float32). */
void decode_item_done(const struct decode_plan *plan, int64_t i, int64_t H, int64_t G, void *out, int out_bf16);

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ATTENTION_AVX512BF16 1 /* bf16.h brings immintrin.h */

/* Each of rows[0..len)'s first `bytes` into L2: blocks are scattered, where the hardware prefetcher
 * cannot run ahead. */
static inline void prefetch_rows(const void **rows, int64_t len, int64_t bytes) {
    for (int64_t t = 0; t < len; t++)
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)rows[t] + o, _MM_HINT_T1);
}

/* The first `bytes` of each of rows 0..len (row t at base + (token t's slot) * row_bytes) into L2, from the
 * block table: where bytes is the whole row, each block's rows as one run of lines. */
static inline void prefetch_blocks(const void *base, const int64_t *table, int64_t len, int64_t block_size,
                                   int64_t row_bytes, int64_t bytes) {
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const char *block = (const char *)base + table[b] * block_size * row_bytes;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        if (bytes == row_bytes)
            for (int64_t o = 0; o < n * row_bytes; o += 64) _mm_prefetch(block + o, _MM_HINT_T1);
        else
            for (int64_t i = 0; i < n; i++)
                for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(block + i * row_bytes + o, _MM_HINT_T1);
    }
}

/* The 16 keys from t0 that are among the first len (t0 + i < len): the rest are a block's unused slots, stale,
 * or keys a row does not see. */
static inline __mmask16 valid_keys(int64_t t0, int64_t len) {
    return len - t0 >= 16 ? 0xffff : len > t0 ? (__mmask16)((1u << (len - t0)) - 1) : 0;
}

/* 16 int8 widened to 16 float32 lanes. */
static inline __m512 widen16_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* q = the D bfloat16 at x rounded as an int8 cache row is (D a multiple of 16): each value to the nearest
 * multiple of the returned scale, max |x| / 127. */
static inline float round_row_int8(const uint16_t *x, int64_t D, int8_t *q) {
    __m512 top = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(widen16(x + d)));
    const float most = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
    for (int64_t d = 0; d < D; d += 16)
        _mm_storeu_si128((__m128i *)(q + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(widen16(x + d), inv))));
    return most / 127.f;
}

/* The D int8 values at src as bfloat16 at dst (exact: integers of int8's range; D a multiple of 32). */
static inline void int8_to_bf16(const int8_t *src, uint16_t *dst, int64_t D) {
    for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(widen16_int8(src + d + 16), widen16_int8(src + d)));
}

/* acc (ROWS query heads x 64 dims, in registers) = sum over t < len of p[r * p_stride + t] * v_t, for the 64
 * bfloat16 dims at v_rows[t]; row r is stored at out + r * out_stride, or in float32 at part + r * out_stride
 * where part is not NULL. */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, int64_t len, int64_t p_stride,
                                                               const void **v_rows, int ROWS, uint16_t *out,
                                                               float *part, int64_t out_stride,
                                                               struct prefetch_stream *ahead, int64_t per_row) {
    __m512 acc[4][4];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        stream_prefetch(ahead, per_row);
        __m512 v[4];
        for (int i = 0; i < 4; i++) v[i] = widen16((const uint16_t *)v_rows[t] + 16 * i);
        for (int r = 0; r < ROWS; r++) {
            const __m512 w = _mm512_set1_ps(p[r * p_stride + t]);
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_fmadd_ps(w, v[i], acc[r][i]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < 4; i++) {
            if (part) _mm512_storeu_ps(part + r * out_stride + 16 * i, acc[r][i]);
            else _mm256_storeu_si256((__m256i *)(out + r * out_stride + 16 * i), (__m256i)_mm512_cvtneps_pbh(acc[r][i]));
        }
}

/* weighted_rows for a run-time count of rows (1..4): query heads of one token, D apart; per_row lines of
 * `ahead` (or NULL) prefetched a V row. */
static inline void weighted_heads(const float *p, int64_t len, int64_t p_stride, const void **v_rows, int64_t rows,
                                  uint16_t *out, float *part, int64_t D, struct prefetch_stream *ahead,
                                  int64_t per_row) {
    switch (rows) {
        case 1: weighted_rows(p, len, p_stride, v_rows, 1, out, part, D, ahead, per_row); break;
        case 2: weighted_rows(p, len, p_stride, v_rows, 2, out, part, D, ahead, per_row); break;
        case 3: weighted_rows(p, len, p_stride, v_rows, 3, out, part, D, ahead, per_row); break;
        default: weighted_rows(p, len, p_stride, v_rows, 4, out, part, D, ahead, per_row); break;
    }
}

/* scales[t] = the scale of the int8 row at rows[t] (D values), for t < len. */
static inline void row_scales(const void **rows, int64_t len, int64_t D, float *scales) {
    for (int64_t t = 0; t < len; t++) scales[t] = int8_row_scale(rows[t], D);
}

/* p[r * stride + t] *= scales[t] for r < n, t < len: keys' scales to their scores, values' to their weights. */
static inline void scale_columns(float *p, int64_t n, int64_t stride, const float *scales, int64_t len) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t t = 0; t < len; t++) p[r * stride + t] *= scales[t];
}

/* paged_attention.c's decode scores of one item (rows query heads at q, G per KV head, against the KV heads
 * from h0 of a bfloat16 cache of KVH heads): scores[r * len + t] = scale * q_r . k_t, on AMX tiles where
 * they run. keys: room for len pointers; ahead (or NULL): lines to prefetch meanwhile, spread over the
 * keys. 0 where D is not a multiple of 32. */
int decode_scores_bf16(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const uint16_t *k_cache, int64_t KVH,
                       int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                       float *scores, const void **keys, struct prefetch_stream *ahead);
#endif
