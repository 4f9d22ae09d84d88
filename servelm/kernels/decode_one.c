/* One decoding step of a Llama-family decoder for a single sequence, for CPUs.
 *
 * With one token in flight each op of a layer is a few microseconds of work,
 * and the Python around the ops (module calls, argument checks, dispatch) cost
 * as much as the ops themselves: about 400 calls a step. This walks every
 * layer in one call, running the same kernels in the same order as
 * servelm/models/llama.py's DecoderLayer does on its native path (norm, QKV,
 * RoPE, K/V into the cache, attention, o_proj, norm, gate/up, SiLU * up,
 * down), so its result is bit-identical to that path's. bfloat16 only; the KV
 * cache bfloat16 or int8 (kv_int8.c).
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

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
        const int64_t blocks = position / m->block_size + 1;
        if (m->kv_int8) {
            write_kv_int8(l->k_cache, l->v_cache, qkv + q_size, qkv + q_size + kv_size, 1, 0, &slot, 1, m->kv_heads, D,
                          nthreads);
            paged_decode_int8(qkv, qkv_size, l->k_cache, l->v_cache, table, blocks, &len, attn, 1, m->heads,
                              m->kv_heads, D, m->block_size, m->scale, nthreads);
        } else {
            write_kv(l->k_cache, l->v_cache, (const char *)(qkv + q_size), (const char *)(qkv + q_size + kv_size), 0,
                     &slot, 1, kv_size * (int64_t)sizeof(uint16_t));
            paged_decode_bf16(qkv, qkv_size, l->k_cache, l->v_cache, table, blocks, &len, attn, 1, m->heads,
                              m->kv_heads, D, m->block_size, m->scale, nthreads);
        }
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
