/* One decoding step of a Llama-family decoder for a single sequence, for CPUs.
 *
 * With one token in flight each op of a layer is a few microseconds of work,
 * and the Python around the ops (module calls, argument checks, ctypes) cost
 * as much as the ops themselves: about 400 calls a step. This walks every
 * layer in one call, running the same kernels in the same order as
 * servelm/models/llama.py's DecoderLayer does on its native path (norm, QKV,
 * RoPE, K/V into the cache, attention, o_proj, norm, gate/up, SiLU * up,
 * down), so its result is bit-identical to that path's. bfloat16 only.
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* The kernels of the other files. */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t rows,
                       int64_t hidden, float eps, int nthreads);
void rope_bf16(uint16_t *x, int64_t rows, int64_t stride, int64_t heads, int64_t D, const float *cos_sin,
               const int64_t *positions, int nthreads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inner, int nthreads);
void bf16_gemv(const uint16_t *x, int64_t K, const uint16_t *w, const uint16_t *bias, int64_t N, uint16_t *out,
               int nthreads);
void bf16_gemm_pairs(const uint16_t *x, int64_t M, int64_t K, const uint16_t *pairs, const uint16_t *bias,
                     int64_t N, uint16_t *out, int nthreads);
void int8_linear_bf16(const uint16_t *x, int64_t K, const int8_t *w, const uint16_t *scales, int64_t N,
                      uint16_t *out, int nthreads);
void write_kv(char *k_cache, char *v_cache, const char *key, const char *value, int64_t stride, const int64_t *slots,
              int64_t rows, int64_t row_bytes);
void paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *tables, int64_t max_blocks, const int64_t *lens, uint16_t *out, int64_t B,
                       int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int nthreads);

/* A linear layer [out_features, in_features]: bfloat16 weight, plain or in
 * gemv.c's pair layout, or int8 weight with bfloat16 scales per row
 * (quantization.py); bias NULL or [out_features]. */
struct linear {
    const void *weight;
    const uint16_t *scales; /* NULL: the weight is bfloat16 */
    const uint16_t *bias;
    int64_t pairs; /* nonzero: the bfloat16 weight is in the pair layout */
};

struct decoder_layer {
    const uint16_t *input_norm, *post_norm;
    struct linear qkv, o, gate_up, down;
    uint16_t *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
};

struct decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos_sin; /* [positions, head_dim]: cos then sin */
    const uint16_t *final_norm;
    const struct decoder_layer *layers;
};

/* As models.packed.PackedLinear and models.quantization.Int8Linear compute it
 * (the int8 layer adds its bias in bfloat16 after rounding, as PyTorch does). */
static void linear(const struct linear *l, const uint16_t *x, int64_t K, int64_t N, uint16_t *out, int nthreads) {
    if (l->pairs) {
        bf16_gemm_pairs(x, 1, K, l->weight, l->bias, N, out, nthreads);
        return;
    }
    if (!l->scales) {
        bf16_gemv(x, K, l->weight, l->bias, N, out, nthreads);
        return;
    }
    int8_linear_bf16(x, K, l->weight, l->scales, N, out, nthreads);
    if (l->bias)
        for (int64_t n = 0; n < N; n++) out[n] = f32_to_bf16(bf16_to_f32(out[n]) + bf16_to_f32(l->bias[n]));
}

/* x: [hidden], the token's embedding; on return, the final norm of the last
 * layer's output. position: the token's position (its K/V go to that slot);
 * table: the sequence's block table, covering position. */
void decode_one_bf16(const struct decoder *m, uint16_t *x, int64_t position, const int64_t *table, int nthreads) {
    const int64_t hidden = m->hidden, D = m->head_dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, len = position + 1;
    const int64_t slot = table[position / m->block_size] * m->block_size + position % m->block_size;
    uint16_t *residual = malloc(sizeof(uint16_t) * (size_t)(2 * hidden + qkv_size + q_size + 3 * m->intermediate));
    uint16_t *normed = residual + hidden, *qkv = normed + hidden, *attn = qkv + qkv_size;
    uint16_t *gate_up = attn + q_size, *act = gate_up + 2 * m->intermediate;
    memcpy(residual, x, sizeof(uint16_t) * (size_t)hidden);
    for (int64_t i = 0; i < m->num_layers; i++) {
        const struct decoder_layer *l = m->layers + i;
        /* The first layer's input is the embedding itself; later ones add x to the residual first. */
        add_rms_norm_bf16(x, i ? residual : NULL, l->input_norm, normed, 1, hidden, m->eps, nthreads);
        linear(&l->qkv, normed, hidden, qkv_size, qkv, nthreads);
        rope_bf16(qkv, 1, qkv_size, m->heads + m->kv_heads, D, m->cos_sin, &position, nthreads);
        write_kv((char *)l->k_cache, (char *)l->v_cache, (const char *)(qkv + q_size),
                 (const char *)(qkv + q_size + kv_size), 0, &slot, 1, kv_size * (int64_t)sizeof(uint16_t));
        paged_decode_bf16(qkv, qkv_size, l->k_cache, l->v_cache, table, position / m->block_size + 1, &len, attn, 1,
                          m->heads, m->kv_heads, D, m->block_size, m->scale, nthreads);
        linear(&l->o, attn, q_size, hidden, x, nthreads);
        add_rms_norm_bf16(x, residual, l->post_norm, normed, 1, hidden, m->eps, nthreads);
        linear(&l->gate_up, normed, hidden, 2 * m->intermediate, gate_up, nthreads);
        silu_mul_bf16(gate_up, act, 1, m->intermediate, nthreads);
        linear(&l->down, act, m->intermediate, hidden, x, nthreads);
    }
    add_rms_norm_bf16(x, residual, m->final_norm, normed, 1, hidden, m->eps, nthreads);
    memcpy(x, normed, sizeof(uint16_t) * (size_t)hidden);
    free(residual);
}
