/* Attention's scores on the AMX tile unit, for CPUs that have it (the bfloat16 attention kernels ask
 * here first, and run their AVX512-BF16 loops where this does not apply).
 *
 * Prefill: an item's query rows (copied into 16-row tiles) times its keys, which the prefill kernel has
 * already transposed into the tile unit's pair layout, 16 keys a tile; the sums go straight to the scores.
 * Then its softmax weights (exp(score - the row's largest) in bfloat16) times the values, both laid out in
 * pairs of keys by attention_pairs.c: 16 rows x 64 dims a pass, in four tiles of sums, each row's sums then
 * divided by its weights' sum.
 *
 * Decode: for one sequence and one KV head, its G query heads' scores against the keys: a tile of 16 keys x 32 dims
 * (one 16-slot cache block's rows, KVH * D apart) times the query heads' same 32 dims in pairs (the tile unit's
 * layout, built once per KV head) gives 16 keys x 16 query heads (G used) in float32, added over D / 32 such
 * products: exact bfloat16 products summed in float32, as the AVX512-BF16 loop does, in another order. Each
 * query head's 16 scores are then gathered out of the tile's columns into its row of scores.
 *
 * Decode over an int8 cache (attention.h's rows): the query heads are rounded to int8 too, one scale each, and
 * a tile of 16 keys x 64 dims, straight from the cache block, times them gives int32 sums (tdpbssd) that
 * the keys' and the query heads' scales bring back to scores. No bfloat16 copy of the keys is made. Built at
 * first use by servelm/kernels. */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "attention.h"
#include "kernels.h"

#ifdef KERNELS_AMX
static int enabled = 1;

/* Ask for the 16 rows (bytes each, stride apart) of the cache block holding token t of a head whose token 0
 * slot is at head: blocks are scattered, where the hardware prefetcher cannot follow. */
static inline void prefetch_block(const void *head, const int64_t *table, int64_t t, int64_t block_size,
                                  int64_t stride, int64_t bytes) {
    const char *rows = (const char *)head + (table[t / block_size] * block_size + t % block_size) * stride;
    for (int i = 0; i < 16; i++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(rows + i * stride + b, _MM_HINT_T0);
}

/* The indices of column r of a tile of 16 x 16 32-bit sums, for a gather: row i's at 16 i + r. */
static inline __m512i tile_column(int64_t r) {
    const __m512i rows = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_add_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32(16)), _mm512_set1_epi32((int)r));
}
#endif

int decode_scores_use_amx(int want) {
#ifdef KERNELS_AMX
    if (want >= 0) enabled = want;
    return enabled && amx_granted();
#else
    (void)want;
    return 0;
#endif
}

int decode_scores_amx(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const uint16_t *k_cache, int64_t KVH,
                      int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                      float *scores, struct prefetch_stream *ahead) {
#ifdef KERNELS_AMX
    if (!enabled || G > 16 || D % 32 || D > 256 || block_size % 16 || !amx_granted()) return 0;
    /* q_pairs[c][p][r]: dims 32c + 2p, 32c + 2p + 1 of query head r (zero past G), as 32-bit words */
    uint32_t q_pairs[8][16][16] __attribute__((aligned(64)));
    float tile[16][16] __attribute__((aligned(64))); /* [key][query head] */
    const int64_t chunks = D / 32, key_stride = 2 * KVH * D; /* bytes between a block's rows */
    /* The values into L2 meanwhile, as decode_scores_amx_int8's (a 32-row decoding step 2.8-4.2% faster) */
    const int64_t per_chunk = ahead ? stream_lines_per(ahead, rows / G * ((len + 15) / 16)) : 0;
    amx_configure();
    for (int64_t hh = 0; hh < rows / G; hh++) {
        memset(q_pairs, 0, (size_t)chunks * sizeof q_pairs[0]);
        for (int64_t r = 0; r < G; r++)
            for (int64_t c = 0; c < chunks; c++)
                for (int p = 0; p < 16; p++) memcpy(&q_pairs[c][p][r], q + (hh * G + r) * D + 32 * c + 2 * p, 4);
        const uint16_t *k_head = k_cache + (h0 + hh) * D;
        for (int64_t t = 0; t < len && t < 32; t++) /* the first two blocks' rows; the loop asks for the rest */
            for (int64_t b = 0; b < 2 * D; b += 64)
                _mm_prefetch((const char *)(k_head + (table[t / block_size] * block_size + t % block_size) * KVH * D) + b,
                             _MM_HINT_T0);
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const uint16_t *keys = k_head + (table[t0 / block_size] * block_size + t0 % block_size) * KVH * D;
            if (t0 + 32 < len) prefetch_block(k_head, table, t0 + 32, block_size, key_stride, 2 * D); /* 2 on */
            stream_prefetch(ahead, per_chunk);
            _tile_zero(0);
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(1, keys + 32 * c, key_stride);
                _tile_loadd(2, q_pairs[c], 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, tile, 64);
            const __mmask16 valid = valid_keys(t0, len); /* stale rows are in the tile, never stored */
            for (int64_t r = 0; r < G; r++) {
                const __m512 s = _mm512_i32gather_ps(tile_column(r), tile, 4);
                _mm512_mask_storeu_ps(scores + (hh * G + r) * len + t0, valid, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
            }
        }
    }
    _tile_release();
    return 1;
#else
    (void)q, (void)rows, (void)G, (void)D, (void)k_cache, (void)KVH, (void)h0, (void)table, (void)block_size,
        (void)len, (void)scale, (void)scores, (void)ahead;
    return 0;
#endif
}

int prefill_scores_amx(const uint32_t *const *qrows, int64_t rows, int64_t D, const uint32_t *kts, int64_t chunks,
                       float scale, float *scores, int64_t stride, uint16_t *qbuf) {
#ifdef KERNELS_AMX
    if (!enabled || D % 32 || !amx_granted()) return 0;
    const int64_t padded = (rows + 15) / 16 * 16, pairs = D / 2;
    for (int64_t r = 0; r < rows; r++) memcpy(qbuf + r * D, qrows[r], (size_t)D * sizeof(uint16_t));
    memset(qbuf + rows * D, 0, (size_t)((padded - rows) * D) * sizeof(uint16_t));
    amx_configure();
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t r0 = 0; r0 < padded; r0 += 16) {
            _tile_zero(0);
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                _tile_loadd(1, qbuf + r0 * D + d0, 2 * D);
                _tile_loadd(2, kts + (c * pairs + d0 / 2) * 16, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, scores + r0 * stride + 16 * c, 4 * stride);
        }
    _tile_release();
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < 16 * chunks; t += 16)
            _mm512_storeu_ps(scores + r * stride + t, _mm512_mul_ps(_mm512_loadu_ps(scores + r * stride + t), s));
    return 1;
#else
    (void)qrows, (void)rows, (void)D, (void)kts, (void)chunks, (void)scale, (void)scores, (void)stride, (void)qbuf;
    return 0;
#endif
}

int prefill_values_amx(const uint16_t *pbuf, int64_t width, const float *inv_sums, int64_t rows, int64_t first_seen,
                       int64_t G, const uint32_t *vts, int64_t D, uint16_t *const *orows, float *acc) {
#ifdef KERNELS_AMX
    if (!enabled || D % 64 || !amx_granted()) return 0;
    const int64_t padded = (rows + 15) / 16 * 16;
    amx_configure();
    for (int64_t r0 = 0; r0 < padded; r0 += 16) {
        const int64_t top = r0 + 16 < rows ? r0 + 16 : rows; /* the block's rows; its last sees the most keys */
        const int64_t keys = (first_seen + (top - 1) / G + 31) / 32 * 32;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t t = 0; t < keys; t += 32) {
                const uint32_t *v = vts + t / 2 * D + d0; /* 16 pairs of keys x 16 dims a tile */
                _tile_loadd(4, pbuf + r0 * width + t, 2 * width);
                _tile_loadd(5, v, 4 * D);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, v + 16, 4 * D);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, v + 32, 4 * D);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, v + 48, 4 * D);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, acc, 256);
            _tile_stored(1, acc + 16, 256);
            _tile_stored(2, acc + 32, 256);
            _tile_stored(3, acc + 48, 256);
            for (int64_t r = r0; r < top; r++)
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_si256((__m256i *)(orows[r] + d0 + 16 * i),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(
                                            _mm512_loadu_ps(acc + (r - r0) * 64 + 16 * i), _mm512_set1_ps(inv_sums[r]))));
        }
    }
    _tile_release();
    return 1;
#else
    (void)pbuf, (void)width, (void)inv_sums, (void)rows, (void)first_seen, (void)G, (void)vts, (void)D, (void)orows,
        (void)acc;
    return 0;
#endif
}

int decode_scores_amx_int8(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const int8_t *k_cache, int64_t KVH,
                           int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                           float *scores, struct prefetch_stream *ahead) {
#ifdef KERNELS_AMX
    if (!enabled || G > 16 || D % 64 || D > 256 || block_size % 16 || !amx_granted()) return 0;
    /* q_quads[c][p][r]: dims 64c + 4p .. 4p + 3 of query head r rounded to int8 (zero past G), as 32-bit words */
    uint32_t q_quads[4][16][16] __attribute__((aligned(64)));
    int32_t tile[16][16] __attribute__((aligned(64))); /* [key][query head] */
    float q_scale[16];
    const int64_t chunks = D / 64, row = D + 4, key_stride = KVH * row; /* bytes between a block's rows */
    const __m512i scale_at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32((int)key_stride));
    /* The item's values come into L2 while the keys are multiplied, a few lines a tile: a 32-row w8a8 decoding
     * step over the int8 cache 5.4-6.1% faster (AMX VM; without, 15% of its time went to the values' first
     * reads). */
    const int64_t per_chunk = ahead ? stream_lines_per(ahead, rows / G * ((len + 15) / 16)) : 0;
    amx_configure();
    for (int64_t hh = 0; hh < rows / G; hh++) {
        memset(q_quads, 0, (size_t)chunks * sizeof q_quads[0]);
        for (int64_t r = 0; r < G; r++) { /* as write_kv_int8 rounds a row */
            uint32_t words[64]; /* the row's int8, 4 to a word */
            q_scale[r] = scale * round_row_int8(q + (hh * G + r) * D, D, (int8_t *)words);
            for (int64_t w = 0; w < D / 4; w++) q_quads[w / 16][w % 16][r] = words[w];
        }
        const int8_t *k_head = k_cache + (h0 + hh) * row;
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const int8_t *keys = k_head + (table[t0 / block_size] * block_size + t0 % block_size) * key_stride;
            if (t0 + 32 < len) prefetch_block(k_head, table, t0 + 32, block_size, key_stride, row); /* 2 on */
            stream_prefetch(ahead, per_chunk);
            _tile_zero(0);
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(1, keys + 64 * c, key_stride);
                _tile_loadd(2, q_quads[c], 64);
                _tile_dpbssd(0, 1, 2);
            }
            _tile_stored(0, tile, 64);
            const __mmask16 valid = valid_keys(t0, len); /* stale rows are in the tile, never stored */
            const __m512 k_scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, scale_at, keys + D, 1);
            for (int64_t r = 0; r < G; r++) {
                const __m512i s = _mm512_i32gather_epi32(tile_column(r), tile, 4);
                _mm512_mask_storeu_ps(scores + (hh * G + r) * len + t0, valid,
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(k_scale, _mm512_set1_ps(q_scale[r]))));
            }
        }
    }
    _tile_release();
    return 1;
#else
    (void)q, (void)rows, (void)G, (void)D, (void)k_cache, (void)KVH, (void)h0, (void)table, (void)block_size,
        (void)len, (void)scale, (void)scores, (void)ahead;
    return 0;
#endif
}
