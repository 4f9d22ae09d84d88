/* One decoding step of a Llama-family decoder, for CPUs: one new token for
 * each of a batch of sequences.
 *
 * Decoding does little work per op: with one token in flight each op of a
 * layer is a few microseconds, and even 32 sequences' ops are tens of
 * microseconds, while the Python around them (module calls, argument checks,
 * dispatch) costs 5-10 microseconds an op, 10-15 ops a layer. This walks every
 * layer in one call, running the same kernels in the same order as
 * servelm/models/llama.py's DecoderLayer does on its native path for that
 * many rows (norm, QKV, RoPE, K/V into the cache, attention, o_proj, norm,
 * gate/up, SiLU * up, down), so its result is bit-identical to that path's.
 * bfloat16 only; the KV cache bfloat16 or int8 (kv_int8.c).
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* What w8a8_gemm needs of the layer l [N, K] that runs next, to ask for its first weights: packed NULL where
 * there is none or it is not a W8A8 layer. */
static struct w8a8_next then(const struct linear *l, int64_t K, int64_t N) {
    if (!l || l->kind != LINEAR_W8A8) return (struct w8a8_next){NULL, 0, 0, 0};
    return (struct w8a8_next){l->weight, N, K, l->silu_mul ? W8A8_SILU_MUL : 0};
}

/* As models.packed.PackedLinear, models.quantization.Int8Linear and models.w8a8.W8A8Linear compute it for
 * `rows` rows (the int8 layer adds its bias in bfloat16 after rounding, as PyTorch does). */
static void linear(const struct linear *l, const uint16_t *x, int64_t rows, int64_t K, int64_t N, uint16_t *out,
                   int nthreads, struct w8a8_next next) {
    switch (l->kind) {
    case LINEAR_PAIRS:
        if (rows > l->vector_rows)
            bf16_gemm_pairs_amx(x, rows, K, l->weight, l->bias, N, out, nthreads);
        else
            bf16_gemm_pairs(x, rows, K, l->weight, l->bias, N, out, nthreads);
        return;
    case LINEAR_W8A8:
        w8a8_gemm(x, 1, rows, K, l->weight, (const float *)l->scales, l->bias, N, l->silu_mul ? W8A8_SILU_MUL : 0,
                  out, nthreads, next.packed ? &next : NULL);
        return;
    case LINEAR_INT8:
        int8_linear_bf16(x, K, l->weight, (const uint16_t *)l->scales, N, out, nthreads);
        if (l->bias)
            for (int64_t n = 0; n < N; n++) out[n] = f32_to_bf16(bf16_to_f32(out[n]) + bf16_to_f32(l->bias[n]));
        return;
    default: /* LINEAR_PLAIN */
        bf16_gemv(x, rows, K, l->weight, l->bias, N, out, nthreads);
    }
}

/* x: [rows, hidden], the tokens' embeddings; on return, the final norm of the last layer's output. positions:
 * each token's position (its K/V go to that slot); tables: [rows, max_blocks], each sequence's block table,
 * covering its position. */
void decode_step_bf16(const struct decoder *m, uint16_t *x, int64_t rows, const int64_t *positions,
                      const int64_t *tables, int64_t max_blocks, int nthreads) {
    const int64_t hidden = m->hidden, D = m->head_dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = m->intermediate;
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(2 * rows)), *lens = slots + rows;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = positions[r];
        slots[r] = tables[r * max_blocks + p / m->block_size] * m->block_size + p % m->block_size;
        lens[r] = p + 1;
    }
    const size_t row = (size_t)(2 * hidden + qkv_size + q_size + 3 * inter);
    uint16_t *residual = malloc(sizeof(uint16_t) * row * (size_t)rows);
    uint16_t *normed = residual + rows * hidden, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_size;
    uint16_t *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter;
    memcpy(residual, x, sizeof(uint16_t) * (size_t)(rows * hidden));
    for (int64_t i = 0; i < m->num_layers; i++) {
        const struct decoder_layer *l = m->layers + i;
        /* The first layer's input is the embedding itself; later ones add x to the residual first. */
        add_rms_norm_bf16(x, i ? residual : NULL, l->input_norm, normed, rows, hidden, m->eps, nthreads);
        const struct linear *next_qkv = i + 1 < m->num_layers ? &m->layers[i + 1].qkv : NULL;
        linear(&l->qkv, normed, rows, hidden, qkv_size, qkv, nthreads, then(NULL, 0, 0)); /* attention between */
        rope_bf16(qkv, rows, qkv_size, m->heads + m->kv_heads, D, m->cos_sin, positions, nthreads);
        if (m->kv_int8) {
            write_kv_int8(l->k_cache, l->v_cache, qkv + q_size, qkv + q_size + kv_size, 1, qkv_size, slots, rows,
                          m->kv_heads, D, nthreads);
            paged_decode_int8(qkv, qkv_size, l->k_cache, l->v_cache, tables, max_blocks, lens, attn, rows, m->heads,
                              m->kv_heads, D, m->block_size, m->scale, nthreads);
        } else {
            write_kv(l->k_cache, l->v_cache, (const char *)(qkv + q_size), (const char *)(qkv + q_size + kv_size),
                     qkv_size * (int64_t)sizeof(uint16_t), slots, rows, kv_size * (int64_t)sizeof(uint16_t));
            paged_decode_bf16(qkv, qkv_size, l->k_cache, l->v_cache, tables, max_blocks, lens, attn, rows, m->heads,
                              m->kv_heads, D, m->block_size, m->scale, nthreads);
        }
        linear(&l->o, attn, rows, q_size, hidden, x, nthreads, then(&l->gate_up, hidden, 2 * inter));
        add_rms_norm_bf16(x, residual, l->post_norm, normed, rows, hidden, m->eps, nthreads);
        if (l->gate_up.silu_mul) { /* the gate/up GEMM writes SiLU * up itself */
            linear(&l->gate_up, normed, rows, hidden, 2 * inter, act, nthreads, then(&l->down, inter, hidden));
        } else {
            linear(&l->gate_up, normed, rows, hidden, 2 * inter, gate_up, nthreads, then(&l->down, inter, hidden));
            silu_mul_bf16(gate_up, act, rows, inter, nthreads);
        }
        linear(&l->down, act, rows, inter, hidden, x, nthreads, then(next_qkv, hidden, qkv_size));
    }
    add_rms_norm_bf16(x, residual, m->final_norm, normed, rows, hidden, m->eps, nthreads);
    memcpy(x, normed, sizeof(uint16_t) * (size_t)(rows * hidden));
    free(residual);
    free(slots);
}
