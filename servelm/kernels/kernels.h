/* The C kernels' entry points, for the other C files and for the C++ files
 * (ops.cpp, attention_op.cpp, decoder_op.cpp), which register them as PyTorch
 * ops after checking every argument: the kernels themselves trust theirs.
 * bfloat16 travels as its bits (uint16_t). */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* paged_attention.c */
void paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                       int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads);
void paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, float *out, int64_t B, int64_t H,
                      int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads);
/* prefill_attention.c. 0 where it does not run (no AVX512-BF16, D not a multiple of 64): out is then
 * untouched. The cache is bfloat16, or int8 (kv_int8, rows as attention.h lays them out). */
int paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_int8,
                       const int64_t *tables, int64_t max_blocks, const int64_t *q_starts, const int64_t *q_lens,
                       const int64_t *ctx_lens, int64_t S, uint16_t *out, int64_t H, int64_t KVH, int64_t D,
                       int64_t block_size, float scale, int nthreads);

/* kv_int8.c: the int8 KV cache, rows as attention.h lays them out (D int8, then a float32 scale).
 * write_kv_int8: token t's rows of key and value (D values per KV head, bfloat16 where x_bf16, else float32;
 * token t at key + t * stride elements) rounded into slot slots[t] of each cache. paged_decode_int8:
 * paged_decode_bf16 over such a cache; 0 where it does not run (no AVX512-BF16, D not a multiple of 64), as
 * kv_int8_decodes(D) says beforehand. */
void write_kv_int8(int8_t *k_cache, int8_t *v_cache, const void *key, const void *value, int x_bf16, int64_t stride,
                   const int64_t *slots, int64_t tokens, int64_t KVH, int64_t D, int nthreads);
int kv_int8_decodes(int64_t D);
int paged_decode_int8(const uint16_t *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads);

/* attention_amx.c: one sequence's decode scores (the rows query heads at q, G per KV head from h0) on AMX
 * tiles, into scores[r * len + t], scaled; 0 where it does not run (no AMX, block_size not a multiple of 16, D
 * not a multiple of 32 or over 256, more than 16 query heads per KV head, or turned off).
 * decode_scores_use_amx(want): with want 0 or 1, turns it off or on for the whole process (-1 leaves it);
 * returns whether it runs now where the shapes allow. */
int decode_scores_use_amx(int want);
/* Prefill's scores the same way (where decode_scores_use_amx allows, D a multiple of 32): scores[r * stride +
 * 16c + j] = scale * q_r . key 16c + j for the rows query rows at qrows (D each) against chunks of 16 keys,
 * transposed at kts as prefill_attention.c lays them out (the tile unit's pair layout). scores has
 * room for rows rounded up to 16; qbuf for as many rows of D. */
int prefill_scores_amx(const uint32_t *const *qrows, int64_t rows, int64_t D, const uint32_t *kts, int64_t chunks,
                       float scale, float *scores, int64_t stride, uint16_t *qbuf);
/* attention_pairs.c: prefill's weighted values in pairs of keys (AVX512-BF16 builds; no-ops elsewhere).
 * prefill_pair_values: one (sequence, KV head)'s values (rows[t], t < ctx; int8 where kv_int8, widened in wide:
 * room for 2 D) in pairs of keys: vt[(t / 2) * D + d] = dim d of values t (low half) and t + 1, zero past ctx
 * (a stale slot's NaN would reach the sums even at weight 0), to a multiple of 32 keys: prefill_pair_words(ctx,
 * D) words. prefill_pair_softmax: an item's rows of softmax weights over its scores (p[r * stride + t], row r
 * seeing the first first_seen + r / G keys), exp(p - the row's largest) times v_scales[t] where not NULL (an
 * int8 cache's values' scales), rounded to bfloat16 at pbuf, zero past the keys each row sees and in rows
 * rows .. padded; inv_sums[r] = 1 / the row's sum of exp rounded to bfloat16 (the weights the values get,
 * without the scales: normalising by the unrounded sum put a bias into every row); returns the row width
 * (bfloat16 apart in pbuf): the last row's keys rounded up to 32. prefill_values_pairs: orows[r] (D
 * bfloat16, D a multiple of 64) = inv_sums[r] times the sum over the keys row r sees of its bfloat16 weight
 * times value t, from those two layouts (vdpbf16ps). */
int64_t prefill_pair_words(int64_t ctx, int64_t D);
void prefill_pair_values(const void **rows, int64_t ctx, int64_t D, int kv_int8, uint16_t *wide, uint32_t *vt);
int64_t prefill_pair_softmax(const float *p, const float *v_scales, int64_t rows, int64_t padded, int64_t stride,
                             int64_t first_seen, int64_t G, uint16_t *pbuf, float *inv_sums);
void prefill_values_pairs(const uint16_t *pbuf, int64_t width, const float *inv_sums, int64_t rows,
                          int64_t first_seen, int64_t G, const uint32_t *vts, int64_t D, uint16_t *const *orows);
/* prefill_values_pairs on AMX tiles (where decode_scores_use_amx allows, D a multiple of 64), the weights in
 * rows rounded up to 16 (prefill_pair_softmax's padded); acc: 16 x 64 float32. 0 where it does not run. */
int prefill_values_amx(const uint16_t *pbuf, int64_t width, const float *inv_sums, int64_t rows, int64_t first_seen,
                       int64_t G, const uint32_t *vts, int64_t D, uint16_t *const *orows, float *acc);
struct prefetch_stream;
int decode_scores_amx(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const uint16_t *k_cache, int64_t KVH,
                      int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale, float *scores,
                      struct prefetch_stream *ahead);
/* The same over an int8 cache (kv_int8.c), D a multiple of 64: the query heads rounded to int8 as the cache's
 * rows are, int8 products summed in int32 (tdpbssd), both scales applied. Both prefetch the lines of `ahead`
 * (attention.h; or NULL) meanwhile. */
int decode_scores_amx_int8(const uint16_t *q, int64_t rows, int64_t G, int64_t D, const int8_t *k_cache, int64_t KVH,
                           int64_t h0, const int64_t *table, int64_t block_size, int64_t len, float scale,
                           float *scores, struct prefetch_stream *ahead);

/* fused_ops.c */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t rows,
                       int64_t hidden, float eps, int nthreads);
void add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t hidden,
                      float eps, int nthreads);
void rope_bf16(uint16_t *x, int64_t rows, int64_t stride, int64_t heads, int64_t D, const float *cos_sin,
               const int64_t *positions, int nthreads);
void rope_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t D, const float *cos_sin,
              const int64_t *positions, int nthreads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inner, int nthreads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inner, int nthreads);
/* Per row r of x [rows, V] (row r at x + r * stride), what the sampler needs of its log_softmax without writing
 * it: log_softmax(x) = x - largest[r] - logsum[r]. largest and at are torch.max's value and first index (a NaN
 * counts as largest); logsum is NaN where largest is not finite, as the log_softmax row is then. */
void log_softmax_stats_f32(const float *x, int64_t rows, int64_t V, int64_t stride, float *largest, int64_t *at,
                           float *logsum, int nthreads);
void write_kv(char *k_cache, char *v_cache, const char *key, const char *value, int64_t stride, const int64_t *slots,
              int64_t rows, int64_t row_bytes);

/* sample.c: one random draw per row r of x [rows, V] (row r at x + r * stride) from softmax(x[r] * scale[r])
 * after top-k (top_k[r] <= 0 or >= V: none), top-p (top_p[r] >= 1: none) and min-p (min_p[r] <= 0: none): the
 * first index whose running sum of the kept weights exceeds u[r] (in [0, 1)) times their total, never a token
 * of weight 0; -1 for a row with a NaN or +inf, or nothing above -inf (or no memory for a truncating row).
 * largest[r], logsum[r]: as log_softmax_stats_f32 gives them (NaN both where the row had no memory). */
void draw_f32(const float *x, int64_t rows, int64_t V, int64_t stride, const float *scale, const int64_t *top_k,
              const float *top_p, const float *min_p, const float *u, int64_t *token, float *largest, float *logsum,
              int nthreads);

/* sample.c: the k largest values of each row rows[r] of x [.., V] (row i at x + i * stride), k <= V, with their
 * indices, largest first (of equal values the lower index first), into values and ids [n, k]: a min-heap of the
 * k largest so far, which a value enters only above its least. */
void top_values_f32(const float *x, int64_t V, int64_t stride, const int64_t *rows, int64_t n, int64_t k,
                    float *values, int64_t *ids, int nthreads);

/* gemv.c: out [M, N] = x [M, K] W^T (+ bias) over a plain weight, for one row and a few (each row summed as
 * when it comes alone) */
void bf16_gemv(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N,
               uint16_t *out, int nthreads);
void f32_gemv(const float *x, int64_t M, int64_t K, const float *w, const float *bias, int64_t N, float *out,
              int nthreads);
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads);

/* gemm_pairs.c */
int bf16_pairs_supported(void);
void bf16_pack_pairs(const uint16_t *w, int64_t N, int64_t K, uint16_t *pairs, int nthreads);
void bf16_gemm_pairs(const uint16_t *x, int64_t M, int64_t K, const uint16_t *pairs, const uint16_t *bias,
                     int64_t N, uint16_t *out, int nthreads);
/* The same on AMX tiles: bf16_pairs_amx_supported(K) says where it runs (an AMX CPU, K a multiple of 32). */
int bf16_pairs_amx_supported(int64_t K);
void bf16_gemm_pairs_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *pairs, const uint16_t *bias,
                         int64_t N, uint16_t *out, int nthreads);

/* w8a8.c: W [N, K] int8 packed by w8a8_pack into w8a8_packed_bytes(N, K) bytes; x and out [M, K] / [M, N]
 * bfloat16 (x_bf16) or float32, bias [N] of x's dtype or NULL, scales [N] float32. flags W8A8_SILU_MUL: W's
 * rows come in pairs of 16-row blocks, gate then up (N a multiple of 32), and out [M, N / 2] is silu_mul's
 * result over the product's, block pair by block pair; W8A8_F32_OUT: out is float32 whatever x's dtype, with
 * the values rounded to it. Without AVX512-VNNI, w8a8_supported() is 0 and w8a8_gemm does nothing.
 * w8a8_use_amx(want): with want 0 or 1, turns the AMX path off or on for the whole process (-1 leaves it);
 * returns whether w8a8_gemm runs it now. */
#define W8A8_SILU_MUL 1
#define W8A8_F32_OUT 2
/* The GEMM that runs next on the same rows (decode_step.c's next layer), whose first weights a call with
 * one chunk of rows asks for while it ends: its packed weight, N, K and flags. */
struct w8a8_next {
    const int8_t *packed;
    int64_t N, K;
    int flags;
};
int w8a8_supported(void);
int w8a8_use_amx(int want);
int64_t w8a8_packed_bytes(int64_t N, int64_t K);
int w8a8_packed_matches(const int8_t *packed, int64_t bytes, int64_t N, int64_t K);
void w8a8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *packed, int nthreads);
void w8a8_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *packed, const float *scales,
               const void *bias, int64_t N, int flags, void *out, int nthreads, const struct w8a8_next *next);

/* decode_step.c: a linear layer [out_features, in_features], as the model's layer keeps it for the rows a
 * step decodes: LINEAR_PLAIN, a bfloat16 weight (one row); LINEAR_PAIRS, bfloat16 in gemm_pairs.c's pair layout (up
 * to vector_rows rows on vectors, more on AMX tiles); LINEAR_INT8, int8 with bfloat16 scales per row
 * (quantization.py; one row); LINEAR_W8A8, w8a8_pack's layout with float32 scales (w8a8.py), gate/up in pairs
 * of 16-row blocks writing silu_mul's result where silu_mul. bias NULL or bfloat16 [out_features]. */
enum linear_kind { LINEAR_PLAIN, LINEAR_PAIRS, LINEAR_INT8, LINEAR_W8A8 };

struct linear {
    const void *weight;
    const void *scales;
    const uint16_t *bias;
    int64_t kind, vector_rows, silu_mul;
};

struct decoder_layer {
    const uint16_t *input_norm, *post_norm;
    struct linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] bfloat16, or int8 rows (kv_int8) */
};

struct decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int kv_int8; /* the caches are int8 (kv_int8.c); kv_int8_decodes(head_dim) */
    float eps, scale;
    const float *cos_sin; /* [positions, head_dim]: cos then sin */
    const uint16_t *final_norm;
    const struct decoder_layer *layers;
};

void decode_step_bf16(const struct decoder *m, uint16_t *x, int64_t rows, const int64_t *positions,
                      const int64_t *tables, int64_t max_blocks, int nthreads);

#ifdef __cplusplus
}
#endif
