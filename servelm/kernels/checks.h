/* The argument checks the ops of ops.cpp, attention_op.cpp and decoder_op.cpp share: a failed
 * one raises ValueError in Python, naming the op and what it expected. */
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

#define CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

namespace servelm {

/* A bfloat16 tensor's data as its bits, the kernels' bfloat16 type. */
inline uint16_t *bits(const at::Tensor &t) { return static_cast<uint16_t *>(t.data_ptr()); }

inline void check_cpu(const char *op, std::initializer_list<const at::Tensor *> tensors) {
    for (const at::Tensor *t : tensors) CHECK_ARG(t->device().is_cpu(), op, ": tensors must be on the CPU");
}

/* x bfloat16 or float32, and the others of x's dtype. */
inline void check_float(const char *op, const at::Tensor &x, std::initializer_list<const at::Tensor *> others) {
    const auto dtype = x.scalar_type();
    CHECK_ARG(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": bfloat16 or float32 only, not ", dtype);
    for (const at::Tensor *t : others)
        CHECK_ARG(t->scalar_type() == dtype, op, ": tensors must share one dtype (", dtype, " and ",
                  t->scalar_type(), ")");
}

/* An int8 KV cache (attention.h's rows: head_dim int8, then a float32 scale) has a last axis of head_dim + 4. */
inline bool kv_int8(const at::Tensor &kv_cache) { return kv_cache.scalar_type() == at::kChar; }

inline int64_t cache_head_dim(const at::Tensor &kv_cache) { return kv_cache.size(4) - (kv_int8(kv_cache) ? 4 : 0); }

/* The entries of a block table that `tokens` tokens occupy name blocks of the cache. */
inline void check_table(const char *op, const int64_t *table, int64_t tokens, int64_t block_size,
                        int64_t num_blocks) {
    for (int64_t i = 0; i < (tokens + block_size - 1) / block_size; i++)
        CHECK_ARG(table[i] >= 0 && table[i] < num_blocks, op, ": block table entry ", table[i],
                  " is not a block of the cache's ", num_blocks);
}

}  // namespace servelm
