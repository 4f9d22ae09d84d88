/* The int8 KV cache (--kv-cache-dtype int8): half the bytes of a bfloat16 cache to keep and to read at every
 * decoding step, which at a few dozen sequences reads about as much K/V as weights.
 *
 * Each row (one token's one KV head, attention.h) is rounded on its own: scale = max |x| / 127, each value
 * to the nearest multiple of it. Decoding rounds each query head to int8 the same way and sums its products
 * with the keys in int32, read in place: on AMX-INT8 tiles where the CPU has them (attention_amx.c),
 * elsewhere by AVX512-VNNI's vpdpbusd over 16 keys transposed in registers; the keys' and the query heads'
 * scales then multiply the sums. The values are summed in integers too (int8_values), their scales folded
 * into the weights. Prefill reads the int8 cache in prefill_attention.c's kernel. Built at first use by
 * servelm/kernels. */
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
    /* threaded from 16 tokens: at 32 decoding rows that paid, with fused_ops.c's norms and RoPE */
    _Pragma("omp parallel for num_threads(nthreads) if (tokens >= 16)")
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t at = (t * stride + h * D) * elem;
            quantize_row((const char *)key + at, x_bf16, D, k_cache + (slots[t] * KVH + h) * row);
            quantize_row((const char *)value + at, x_bf16, D, v_cache + (slots[t] * KVH + h) * row);
        }
}

/* Decoding over an int8 cache needs AVX512-BF16 (the values' sums, bfloat16 output) and AVX512-VNNI (the
 * scores): every CPU with the first has the second. */
#if defined(ATTENTION_AVX512BF16) && defined(__AVX512VNNI__)
#define KV_INT8_DECODE 1
#endif

int kv_int8_decodes(int64_t D) {
#ifdef KV_INT8_DECODE
    return D % 64 == 0;
#else
    (void)D;
    return 0;
#endif
}

#ifdef KV_INT8_DECODE
/* The loops below run a constant number of times: unrolled, their vectors stay in registers. */
#define UNROLL _Pragma("GCC unroll 16")

/* r[p] = dword p of each of the 16 vectors (lane j of r[p]: dword p of vector j), in place: a 16 x 16 transpose
 * of 32-bit words, 64 shuffles. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    UNROLL for (int i = 0; i < 8; i++) { /* per 128-bit lane: dwords of vectors 2i, 2i+1 interleaved */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    UNROLL for (int i = 0; i < 4; i++) { /* r[4i + k], lane L: dword 4L + k of vectors 4i .. 4i + 3 */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    UNROLL for (int k = 0; k < 4; k++) { /* lane L of r[k], r[4 + k], r[8 + k], r[12 + k] into vector 4L + k */
        const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
        t[k] = _mm512_shuffle_i32x4(a, c, 0x88), t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD), t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    UNROLL for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The int32 sums q_r . k_j of ROWS query heads (int8, D / 4 words each at qw, row r at qw + r * D / 4) and the
 * 16 keys at keys[j] + off (int8 rows of D, a multiple of 64), by vpdpbusd: each 64-dim chunk of the 16 keys,
 * flipped to unsigned (k + 128), transposed so that vector p holds dims 4p .. 4p + 3 of every key, times each
 * row's 4 dims broadcast; the flip adds 128 * sum q_r, which the caller takes off. */
static inline __attribute__((always_inline)) void key_sums(const uint32_t *qw, const void *const *keys, int64_t off,
                                                          int64_t D, int ROWS, __m512i *sums) {
    __m512i acc[4][2];
    UNROLL for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t c = 0; c < D / 64; c++) {
        __m512i k[16];
        UNROLL for (int j = 0; j < 16; j++)
            k[j] = _mm512_xor_si512(_mm512_loadu_si512((const int8_t *)keys[j] + off + 64 * c), _mm512_set1_epi8((char)0x80));
        transpose16(k);
        UNROLL for (int p = 0; p < 16; p++) /* two chains a row: the adds' latency, not their rate, bounds one */
            UNROLL for (int r = 0; r < ROWS; r++)
                acc[r][p & 1] = _mm512_dpbusd_epi32(acc[r][p & 1], k[p], _mm512_set1_epi32((int)qw[r * D / 4 + 16 * c + p]));
    }
    UNROLL for (int r = 0; r < ROWS; r++) sums[r] = _mm512_add_epi32(acc[r][0], acc[r][1]);
}

/* scores[r * len + t] = scale * q_r . k_t for an item's rows query heads (bfloat16 at q, G per KV head)
 * against its int8 keys (KV heads from h0): each query head rounded to int8 as a cache row is (its own scale),
 * int8 products summed exactly, then the two scales; largest[r] = row r's largest score. keys: room for len
 * pointers; k_scales: room for the keys' scales (len a KV head); the lines of `ahead` are prefetched
 * meanwhile. */
static void decode_scores_int8(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const int8_t *k_cache,
                               int64_t KVH, int64_t h0, const int64_t *table, int64_t block_size, int64_t len,
                               float scale, float *scores, float *largest, const void **keys, float *k_scales,
                               struct prefetch_stream *ahead) {
    const int64_t row = kv_row_bytes(D, 1), heads = rows / G;
    row_pointers(k_cache + h0 * row, table, len, block_size, KVH * row, keys);
    prefetch_rows(keys, len, heads * row);
    /* Every key's scale first, in one pass: the first reads of the keys' lines, many in flight at once, instead
     * of sixteen a chunk beside its sums (a 32-row w8a8 decoding step 0.4-1.0% faster, steps alternating in
     * one process). */
    for (int64_t t = 0; t < len; t++)
        for (int64_t hh = 0; hh < heads; hh++) k_scales[hh * len + t] = int8_row_scale((const int8_t *)keys[t] + hh * row, D);
    const int64_t per_chunk = stream_lines_per(ahead, heads * ((len + 15) / 16));
    int8_t qi[G * D] __attribute__((aligned(64))); /* a KV head's query heads in int8 (on the stack: a malloc per */
    float q_scales[G];                               /* item cost more than short items themselves) */
    int32_t flips[G];
    for (int64_t hh = 0; hh < heads; hh++) {
        __m512 top[G]; /* each row's largest score so far, lane by lane: softmax then skips that pass */
        for (int64_t r = 0; r < G; r++) {
            top[r] = _mm512_set1_ps(-INFINITY);
            q_scales[r] = scale * round_row_int8(q + (hh * G + r) * D, D, qi + r * D);
            int32_t sum = 0;
            for (int64_t d = 0; d < D; d++) sum += qi[r * D + d];
            flips[r] = 128 * sum;
        }
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            stream_prefetch(ahead, per_chunk);
            const int64_t n = len - t0 < 16 ? len - t0 : 16;
            const void *const *at = keys + t0, *tail[16];
            if (n < 16) { /* past len, the chunk's first key again: its sums are never stored */
                for (int j = 0; j < 16; j++) tail[j] = keys[t0 + (j < n ? j : 0)];
                at = tail;
            }
            const __m512 chunk_scales = _mm512_maskz_loadu_ps(valid_keys(t0, len), k_scales + hh * len + t0);
            for (int64_t r0 = 0; r0 < G; r0 += 4) {
                __m512i sums[4];
                const uint32_t *qw = (const uint32_t *)(qi + r0 * D);
                switch (G - r0) {
                    case 1: key_sums(qw, at, hh * row, D, 1, sums); break;
                    case 2: key_sums(qw, at, hh * row, D, 2, sums); break;
                    case 3: key_sums(qw, at, hh * row, D, 3, sums); break;
                    default: key_sums(qw, at, hh * row, D, 4, sums); break;
                }
                for (int64_t r = r0; r < G && r < r0 + 4; r++) {
                    const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r - r0], _mm512_set1_epi32(flips[r])));
                    const __m512 v = _mm512_mul_ps(s, _mm512_mul_ps(chunk_scales, _mm512_set1_ps(q_scales[r])));
                    _mm512_mask_storeu_ps(scores + (hh * G + r) * len + t0, valid_keys(t0, len), v);
                    top[r] = _mm512_mask_max_ps(top[r], valid_keys(t0, len), top[r], v);
                }
            }
        }
        for (int64_t r = 0; r < G; r++) largest[hh * G + r] = _mm512_reduce_max_ps(top[r]);
    }
}

#define FLUSH_PAIRS 256 /* pairs of keys an int32 sum of vpdpwssd takes: 256 * 2 * 32767 * 127 < 2^31 */

/* tot[r][i] += the int32 sums over pairs of keys [p0, p1) of ROWS rows of 15-bit weights (each pair's two as
 * one 32-bit word, row r's at w + r * w_stride) times the 64 int8 values at v_rows[t] + d0, by vpdpwssd: a pair
 * of value rows widened to int16 and interleaved, so that each 32-bit lane holds one dim of both keys. Lane i
 * of vector k holds dim (k / 2) * 32 + (i / 4) * 8 + (k % 2) * 4 + i % 4 (value_order puts them in order). */
static inline __attribute__((always_inline)) void value_sums(const uint32_t *w, int64_t w_stride, const void **v_rows,
                                                            int64_t d0, int64_t len, int64_t p0, int64_t p1,
                                                            int ROWS, __m512 (*tot)[4],
                                                            struct prefetch_stream *ahead, int64_t per_pair) {
    __m512i acc[4][4];
    UNROLL for (int r = 0; r < ROWS; r++) UNROLL for (int k = 0; k < 4; k++) acc[r][k] = _mm512_setzero_si512();
    for (int64_t p = p0; p < p1; p++) {
        stream_prefetch(ahead, per_pair);
        const int8_t *a = (const int8_t *)v_rows[2 * p] + d0; /* past len, the pair's first again: weight 0 */
        const int8_t *b = (const int8_t *)v_rows[2 * p + 1 < len ? 2 * p + 1 : 2 * p] + d0;
        const __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)a));
        const __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(a + 32)));
        const __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)b));
        const __m512i b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)));
        const __m512i v[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                              _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
        UNROLL for (int r = 0; r < ROWS; r++) {
            const __m512i wv = _mm512_set1_epi32((int)w[r * w_stride + p]);
            UNROLL for (int k = 0; k < 4; k++) acc[r][k] = _mm512_dpwssd_epi32(acc[r][k], v[k], wv);
        }
    }
    UNROLL for (int r = 0; r < ROWS; r++)
        UNROLL for (int k = 0; k < 4; k++) tot[r][k] = _mm512_add_ps(tot[r][k], _mm512_cvtepi32_ps(acc[r][k]));
}

/* value_sums' four vectors of one row times scale, in the dims' order, rounded to bfloat16 at out (64 dims),
 * or in float32 at part where it is not NULL. */
static inline void value_order(const __m512 tot[4], float scale, uint16_t *out, float *part) {
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    const __m512 s = _mm512_set1_ps(scale);
    for (int half = 0; half < 2; half++) { /* dims 32 * half .. + 31: vectors 2 * half and 2 * half + 1 */
        const __m512 x = tot[2 * half], y = tot[2 * half + 1];
        const __m512 first = _mm512_mul_ps(_mm512_permutex2var_ps(x, lo, y), s);
        const __m512 second = _mm512_mul_ps(_mm512_permutex2var_ps(x, hi, y), s);
        if (part) {
            _mm512_storeu_ps(part + 32 * half, first);
            _mm512_storeu_ps(part + 32 * half + 16, second);
        } else {
            _mm512_storeu_si512(out + 32 * half, (__m512i)_mm512_cvtne2ps_pbh(second, first));
        }
    }
}

/* out[r] (G query heads, D apart) = sum over t < len of p[r * len + t] / sums[r] * v_t, over the int8 values of
 * one KV head at v_rows[t] (D values, then their scale): each row's weights times the values' scales, rounded
 * to 15 bits of their largest (w: room for G * (len + 1) int16), then summed by value_sums, the row's 1 /
 * sums[r] applied with the rounding's unit (p: softmax's weights before their division by the sum); in
 * float32 at part (same layout) where it is not NULL. per_pair lines of `ahead` are prefetched a pair of keys. */
static void int8_values(const float *p, const float *sums, int64_t len, int64_t G, int64_t D, const void **v_rows,
                        float *v_scales, int16_t *w, uint16_t *out, float *part, struct prefetch_stream *ahead,
                        int64_t per_pair) {
    const int64_t pairs = (len + 1) / 2, w_stride = 2 * pairs;
    float unit[G]; /* a row's weight 1 */
    row_scales(v_rows, len, D, v_scales);
    for (int64_t r = 0; r < G; r++) {
        const float *pr = p + r * len;
        int16_t *wr = w + r * w_stride;
        __m512 top = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = valid_keys(t, len);
            top = _mm512_max_ps(top, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pr + t), _mm512_maskz_loadu_ps(m, v_scales + t)));
        }
        const float most = _mm512_reduce_max_ps(top);
        const __m512 to_int = _mm512_set1_ps(most > 0.f ? 32767.f / most : 0.f);
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = valid_keys(t, len);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, pr + t), _mm512_maskz_loadu_ps(m, v_scales + t));
            _mm256_mask_storeu_epi16(wr + t, m, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, to_int))));
        }
        if (len % 2) wr[len] = 0; /* the last pair's missing key */
        unit[r] = most / 32767.f / sums[r];
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64)
        for (int64_t r0 = 0; r0 < G; r0 += 4) {
            const int rows = G - r0 < 4 ? (int)(G - r0) : 4;
            const uint32_t *wr = (const uint32_t *)(w + r0 * w_stride);
            __m512 tot[4][4];
            for (int r = 0; r < rows; r++)
                for (int k = 0; k < 4; k++) tot[r][k] = _mm512_setzero_ps();
            for (int64_t p0 = 0; p0 < pairs; p0 += FLUSH_PAIRS) {
                const int64_t p1 = pairs - p0 < FLUSH_PAIRS ? pairs : p0 + FLUSH_PAIRS;
                switch (rows) {
                    case 1: value_sums(wr, pairs, v_rows, d0, len, p0, p1, 1, tot, ahead, per_pair); break;
                    case 2: value_sums(wr, pairs, v_rows, d0, len, p0, p1, 2, tot, ahead, per_pair); break;
                    case 3: value_sums(wr, pairs, v_rows, d0, len, p0, p1, 3, tot, ahead, per_pair); break;
                    default: value_sums(wr, pairs, v_rows, d0, len, p0, p1, 4, tot, ahead, per_pair); break;
                }
            }
            for (int r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * D + d0;
                value_order(tot[r], unit[r0 + r], out + at, part ? part + at : NULL);
            }
        }
}

/* Work items as paged_decode_bf16's (decode_plan.c): one sequence and a range of its KV heads, over its keys or
 * a part of them. */
int paged_decode_int8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads) {
    if (!kv_int8_decodes(D)) return 0;
    const int64_t G = H / KVH, split = B >= nthreads ? 1 : KVH, heads = KVH / split, rows = heads * G;
    const int64_t row = kv_row_bytes(D, 1);
    struct decode_plan plan = decode_plan(lens, B, split, heads, rows, D, block_size);
    const int64_t longest = plan.longest;
    int64_t claimed = 0; /* items handed out: a thread claims its next one a step ahead */
    _Pragma("omp parallel num_threads(nthreads)") {
        /* one workspace per thread: scores [rows, longest], scales [heads, longest] (the keys' during the scores,
         * then a KV head's values'), row pointers, a KV head's weights [G, longest + 1] */
        float *scores = malloc(sizeof(float) * (size_t)((rows + heads) * longest) + sizeof(void *) * (size_t)longest +
                               sizeof(int16_t) * (size_t)(G * (longest + 1)));
        float *v_scales = scores + rows * longest;
        const void **row_at = (const void **)(v_scales + heads * longest);
        int16_t *weights = (int16_t *)(row_at + longest);
        int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (next < plan.count) {
            const int64_t item = next, b = plan.items[item].b, h0 = plan.items[item].h0, len = plan.items[item].len;
            const int64_t *table = tables + b * max_blocks + plan.items[item].first / block_size;
            const uint16_t *qb = q + b * q_stride + h0 * G * D;
            float *part = decode_part(&plan, item); /* float32 sums for the merge, or NULL: rows to out */
            next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            /* As paged_decode_bf16: the values come in while the scores are summed, the next item's keys while
             * the values are. */
            struct prefetch_stream values = decode_item_stream(&plan, item, v_cache, row, heads, KVH * row, tables,
                                                               max_blocks, block_size),
                                   keys = decode_item_stream(&plan, next, k_cache, row, heads, KVH * row, tables,
                                                             max_blocks, block_size);
            float largest[rows], sums[rows];
            if (decode_scores_amx_int8(qb, rows, G, D, k_cache, KVH, h0, table, block_size, len, scale, scores, &values))
                for (int64_t r = 0; r < rows; r++) largest[r] = largest_(scores + r * len, len);
            else /* each row's largest found as its scores were stored (0.5-0.8% faster a 32-row w8a8 step) */
                decode_scores_int8(qb, rows, G, D, k_cache, KVH, h0, table, block_size, len, scale, scores, largest,
                                   row_at, v_scales, &values);
            /* Softmax's weights left undivided: each row's sum goes into its values' unit instead (a pass over
             * the scores fewer; a 32-row w8a8 decoding step 0.7-1.1% faster, steps alternating in one process). */
            for (int64_t r = 0; r < rows; r++) {
                sums[r] = softmax_weights_(scores + r * len, len, largest[r]);
                if (part) part[rows * D + 2 * r] = largest[r], part[rows * D + 2 * r + 1] = sums[r];
            }
            const int64_t per_pair = stream_lines_per(&keys, heads * (D / 64) * ((G + 3) / 4) * ((len + 1) / 2));
            /* All the item's values asked for at once, a block's rows of its KV heads as one run of lines where
             * it has them all (the whole row): against each head's rows asked for before its sums, a 32-row
             * w8a8 decoding step 0.7-1.2% faster (three runs, steps alternating in one process). Its keys the
             * same way made the step 6% slower (docs/BENCHMARKS.md). */
            prefetch_blocks(v_cache + h0 * row, table, len, block_size, KVH * row, heads * row);
            for (int64_t hh = 0; hh < heads; hh++) {
                row_pointers(v_cache + (h0 + hh) * row, table, len, block_size, KVH * row, row_at);
                int8_values(scores + hh * G * len, sums + hh * G, len, G, D, row_at, v_scales, weights,
                            out + (b * H + (h0 + hh) * G) * D, part ? part + hh * G * D : NULL, &keys, per_pair);
            }
            decode_item_done(&plan, item, H, G, out, 1);
        }
        free(scores);
    }
    decode_plan_free(&plan);
    return 1;
}
#else
int paged_decode_int8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads) {
    return 0;
}
#endif
