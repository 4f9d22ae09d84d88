/* servelm's attention kernels and the KV cache's writes as PyTorch ops (namespace servelm): paged decode and
 * prefill attention over a bfloat16, float32 or int8 cache, and write_kv. Like ops.cpp's, each op checks what
 * its kernel will read (shapes, dtypes, every slot and block-table entry) and raises ValueError instead of
 * calling C. Built at first use by servelm/kernels/build.py. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

namespace servelm {

namespace {

/* A 3-D tensor whose last two axes are dense (each token's heads contiguous): the kernels take a stride for
 * the first axis only, so anything else is copied. */
at::Tensor heads_dense(const at::Tensor &t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

void check_kv_cache(const char *op, const at::Tensor &kv_cache) {
    CHECK_ARG(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(2) > 0 && cache_head_dim(kv_cache) > 0,
              op, ": kv_cache must be [2, blocks, block_size, kv_heads, head_dim] (head_dim + 4 bytes in int8)");
    CHECK_ARG(kv_cache.is_contiguous(), op, ": the cache must be contiguous");
}

/* The query (or key) and the cache: both bfloat16 or both float32, or an int8 cache and a bfloat16 or float32
 * query, which the int8 kernels take where they run (bfloat16). */
void check_cache_dtype(const char *op, const at::Tensor &query, const at::Tensor &kv_cache,
                       std::initializer_list<const at::Tensor *> others) {
    check_float(op, query, others);
    if (!kv_int8(kv_cache)) check_float(op, query, {&kv_cache});
}

}  // namespace

std::optional<at::Tensor> decode_attention(const at::Tensor &query_arg, const at::Tensor &kv_cache,
                                           const at::Tensor &tables_arg, const at::Tensor &lens_arg, double scale) {
    const char *op = "decode attention";
    check_cpu(op, {&query_arg, &kv_cache, &tables_arg, &lens_arg});
    check_kv_cache(op, kv_cache);
    check_cache_dtype(op, query_arg, kv_cache, {});
    CHECK_ARG(tables_arg.scalar_type() == at::kLong && lens_arg.scalar_type() == at::kLong, op,
              ": the cache must be contiguous, tables and lens int64");
    const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
    CHECK_ARG(query_arg.dim() == 3 && tables_arg.dim() == 2 && lens_arg.dim() == 1, op,
              ": query [B, H, D], block_tables [B, max_blocks] and lens [B] expected: shapes disagree");
    const int64_t batch = query_arg.size(0), heads = query_arg.size(1), head_dim = query_arg.size(2);
    CHECK_ARG(cache_head_dim(kv_cache) == head_dim && heads % kv_heads == 0 && lens_arg.size(0) == batch &&
                  tables_arg.size(0) == batch,
              op, ": query, cache and lens shapes disagree");
    const at::Tensor query = heads_dense(query_arg), tables = tables_arg.contiguous(), lens = lens_arg.contiguous();
    const int64_t max_blocks = tables.size(1);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens.data_ptr<int64_t>()[b];
        CHECK_ARG(len >= 1 && len <= max_blocks * block_size, op, ": lens[", b, "] = ", len, " is not in [1, ",
                  max_blocks * block_size, "]");
        check_table(op, tables.data_ptr<int64_t>() + b * max_blocks, len, block_size, num_blocks);
    }
    at::Tensor out = at::empty(query.sizes(), query.options());
    if (kv_int8(kv_cache)) {
        if (query.scalar_type() != at::kBFloat16 ||
            !paged_decode_int8(bits(query), query.stride(0), kv_cache[0].data_ptr<int8_t>(),
                               kv_cache[1].data_ptr<int8_t>(), tables.data_ptr<int64_t>(), max_blocks,
                               lens.data_ptr<int64_t>(), bits(out), batch, heads, kv_heads, head_dim, block_size,
                               static_cast<float>(scale), at::get_num_threads()))
            return std::nullopt;
    } else if (query.scalar_type() == at::kBFloat16)
        paged_decode_bf16(bits(query), query.stride(0), bits(kv_cache[0]), bits(kv_cache[1]), tables.data_ptr<int64_t>(),
                          max_blocks, lens.data_ptr<int64_t>(), bits(out), batch, heads, kv_heads, head_dim, block_size,
                          static_cast<float>(scale), at::get_num_threads());
    else
        paged_decode_f32(query.data_ptr<float>(), query.stride(0), kv_cache[0].data_ptr<float>(),
                         kv_cache[1].data_ptr<float>(), tables.data_ptr<int64_t>(), max_blocks,
                         lens.data_ptr<int64_t>(), out.data_ptr<float>(), batch, heads, kv_heads, head_dim, block_size,
                         static_cast<float>(scale), at::get_num_threads());
    return out;
}

bool prefill_attention(const at::Tensor &query_arg, const at::Tensor &kv_cache, const at::Tensor &tables_arg,
                       const at::Tensor &seq_lens_arg, double scale, at::Tensor out) {
    const char *op = "prefill attention";
    check_cpu(op, {&query_arg, &kv_cache, &tables_arg, &seq_lens_arg, &out});
    check_kv_cache(op, kv_cache);
    check_cache_dtype(op, query_arg, kv_cache, {&out});
    CHECK_ARG(out.is_contiguous(), op, ": the cache and out must be contiguous");
    CHECK_ARG(query_arg.dim() == 3 && cache_head_dim(kv_cache) == query_arg.size(2) &&
                  query_arg.size(1) % kv_cache.size(3) == 0,
              op, ": query [T, H, D] and the cache's heads disagree");
    CHECK_ARG(out.dim() == 3 && out.size(0) >= query_arg.size(0) && out.size(1) == query_arg.size(1) &&
                  out.size(2) == query_arg.size(2),
              op, ": out must have the query's heads and at least its rows");
    CHECK_ARG(tables_arg.scalar_type() == at::kLong && tables_arg.dim() == 2, op,
              ": block_tables must be int64 [sequences, max_blocks]");
    const int64_t sequences = tables_arg.size(0);
    CHECK_ARG(seq_lens_arg.scalar_type() == at::kLong && seq_lens_arg.dim() == 2 && seq_lens_arg.size(0) == 3 &&
                  seq_lens_arg.size(1) == sequences,
              op, ": seq_lens must be int64 [3, sequences]");
    if (query_arg.scalar_type() != at::kBFloat16) return false;  // the kernel is bfloat16's only
    const at::Tensor query = heads_dense(query_arg), tables = tables_arg.contiguous(), seq_lens = seq_lens_arg.contiguous();
    const int64_t block_size = kv_cache.size(2), max_blocks = tables.size(1), rows = query.size(0);
    const int64_t *starts = seq_lens.data_ptr<int64_t>(), *q_lens = starts + sequences, *ctx_lens = q_lens + sequences;
    for (int64_t s = 0; s < sequences; s++) {
        CHECK_ARG(starts[s] >= 0 && q_lens[s] >= 0 && starts[s] + q_lens[s] <= rows && q_lens[s] <= ctx_lens[s] &&
                      ctx_lens[s] <= max_blocks * block_size,
                  op, ": sequence ", s, "'s rows or context (", starts[s], ", ", q_lens[s], ", ", ctx_lens[s],
                  ") do not fit the query and its block table");
        check_table(op, tables.data_ptr<int64_t>() + s * max_blocks, ctx_lens[s], block_size, kv_cache.size(1));
    }
    return paged_prefill_bf16(bits(query), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                              kv_int8(kv_cache), tables.data_ptr<int64_t>(), max_blocks, starts, q_lens, ctx_lens,
                              sequences, bits(out), query.size(1), kv_cache.size(3), query.size(2), block_size, static_cast<float>(scale),
                              at::get_num_threads()) != 0;
}

void write_kv(at::Tensor kv_cache, const at::Tensor &key, const at::Tensor &value, const at::Tensor &slots_arg) {
    const char *op = "write_kv";
    check_cpu(op, {&kv_cache, &key, &value, &slots_arg});
    check_kv_cache(op, kv_cache);
    CHECK_ARG(key.dim() == 3 && key.size(1) == kv_cache.size(3) && key.size(2) == cache_head_dim(kv_cache) &&
                  value.sizes() == key.sizes(),
              op, ": key, value and cache shapes disagree");
    CHECK_ARG(value.scalar_type() == key.scalar_type() &&
                  (kv_int8(kv_cache) ? key.scalar_type() == at::kBFloat16 || key.scalar_type() == at::kFloat
                                     : key.scalar_type() == kv_cache.scalar_type()),
              op, ": key and value must have the cache's dtype (bfloat16 or float32 into an int8 cache)");
    const int64_t head_dim = key.size(2), kv_heads = key.size(1), tokens = key.size(0);
    CHECK_ARG(key.stride(2) == 1 && key.stride(1) == head_dim && value.strides() == key.strides(), op,
              ": each token's heads must be contiguous, key and value alike");
    CHECK_ARG(slots_arg.scalar_type() == at::kLong && slots_arg.dim() == 1 && slots_arg.size(0) == tokens, op,
              ": slots must be int64 [tokens]");
    const at::Tensor slots = slots_arg.contiguous();
    const int64_t *slot = slots.data_ptr<int64_t>(), num_slots = kv_cache.size(1) * kv_cache.size(2);
    for (int64_t t = 0; t < tokens; t++)
        CHECK_ARG(slot[t] >= 0 && slot[t] < num_slots, op, ": slot ", slot[t], " is not in the cache's [0, ", num_slots,
                  ")");
    const int64_t size = key.element_size();
    if (kv_int8(kv_cache)) {
        write_kv_int8(kv_cache[0].data_ptr<int8_t>(), kv_cache[1].data_ptr<int8_t>(), key.data_ptr(), value.data_ptr(),
                      key.scalar_type() == at::kBFloat16, key.stride(0), slot, tokens, kv_heads, head_dim,
                      at::get_num_threads());
        return;
    }
    ::write_kv(static_cast<char *>(kv_cache[0].data_ptr()), static_cast<char *>(kv_cache[1].data_ptr()),
               static_cast<const char *>(key.data_ptr()), static_cast<const char *>(value.data_ptr()),
               key.stride(0) * size, slot, tokens, kv_heads * head_dim * size);
}

bool attention_use_amx(std::optional<bool> enable) {
    return ::decode_scores_use_amx(enable ? int(*enable) : -1) != 0;
}

}  // namespace servelm

TORCH_LIBRARY_FRAGMENT(servelm, m) {
    m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor lens, float scale) -> Tensor?");
    m.def("prefill_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
          "Tensor(a!) out) -> bool");
    m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
    m.def("attention_use_amx(bool? enable=None) -> bool", &servelm::attention_use_amx);  // no tensor: every backend
}

TORCH_LIBRARY_IMPL(servelm, CPU, m) {
    m.impl("decode_attention", &servelm::decode_attention);
    m.impl("prefill_attention", &servelm::prefill_attention);
    m.impl("write_kv", &servelm::write_kv);
}
