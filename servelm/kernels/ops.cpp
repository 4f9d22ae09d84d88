/* servelm's C kernels as PyTorch ops (namespace servelm), each with a schema.
 *
 * The kernels read raw pointers and trust them; every op here checks what
 * its kernel will read first (device, dtype, shape, strides, and the slots,
 * positions and block-table entries it will index with) and raises
 * ValueError instead of calling C. Registered through the dispatcher, the ops
 * show by name in torch.profiler. The one-token decoder is in
 * decoder_op.cpp. Built at first use by servelm/kernels/build.py. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight_arg, double eps,
                    const std::optional<at::Tensor> &residual) {
    const char *op = "rms_norm";
    check_cpu(op, {&x, &weight_arg});
    check_float(op, x, {&weight_arg});
    CHECK_ARG(x.dim() >= 1 && x.is_contiguous() &&
                  (!residual || (residual->sizes() == x.sizes() && residual->is_contiguous())),
              op, ": x and residual must be contiguous and of one shape");
    const int64_t hidden = x.size(-1);
    CHECK_ARG(hidden > 0 && weight_arg.dim() == 1 && weight_arg.size(0) == hidden, op, ": weight must be [hidden]");
    if (residual) {
        check_cpu(op, {&*residual});
        check_float(op, x, {&*residual});
    }
    const at::Tensor weight = weight_arg.contiguous();
    at::Tensor out = at::empty_like(x);
    const int64_t rows = x.numel() / hidden;
    if (x.scalar_type() == at::kBFloat16)
        add_rms_norm_bf16(bits(x), residual ? bits(*residual) : nullptr, bits(weight), bits(out), rows, hidden,
                          static_cast<float>(eps), at::get_num_threads());
    else
        add_rms_norm_f32(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                         weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, static_cast<float>(eps),
                         at::get_num_threads());
    return out;
}

void rope_(at::Tensor x, int64_t heads, int64_t head_dim, const at::Tensor &cos_sin, const at::Tensor &positions_arg) {
    const char *op = "rope";
    check_cpu(op, {&x, &cos_sin, &positions_arg});
    check_float(op, x, {});
    CHECK_ARG(x.dim() == 2 && x.stride(1) == 1 && heads >= 0 && head_dim > 0 && head_dim % 2 == 0 &&
                  x.size(1) >= heads * head_dim,
              op, ": x must be [tokens, width] with unit column stride, width at least heads * head_dim (even)");
    CHECK_ARG(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == head_dim,
              op, ": cos_sin must be contiguous float32 [positions, head_dim]");
    CHECK_ARG(positions_arg.scalar_type() == at::kLong && positions_arg.dim() == 1 && positions_arg.size(0) == x.size(0),
              op, ": positions must be int64 [tokens]");
    const at::Tensor positions = positions_arg.contiguous();
    const int64_t *position = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < x.size(0); t++)
        CHECK_ARG(position[t] >= 0 && position[t] < cos_sin.size(0), op, ": position ", position[t],
                  " is past cos_sin's ", cos_sin.size(0), " rows");
    if (x.scalar_type() == at::kBFloat16)
        rope_bf16(bits(x), x.size(0), x.stride(0), heads, head_dim, cos_sin.data_ptr<float>(), position,
                  at::get_num_threads());
    else
        rope_f32(x.data_ptr<float>(), x.size(0), x.stride(0), heads, head_dim, cos_sin.data_ptr<float>(), position,
                 at::get_num_threads());
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
    const char *op = "silu_mul";
    check_cpu(op, {&gate_up});
    check_float(op, gate_up, {});
    CHECK_ARG(gate_up.dim() >= 1 && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, op,
              ": gate_up must be contiguous with an even last axis");
    const int64_t inner = gate_up.size(-1) / 2;
    std::vector<int64_t> sizes = gate_up.sizes().vec();
    sizes.back() = inner;
    at::Tensor out = at::empty(sizes, gate_up.options());
    if (inner == 0) return out;
    const int64_t rows = gate_up.numel() / (2 * inner);
    if (gate_up.scalar_type() == at::kBFloat16)
        silu_mul_bf16(bits(gate_up), bits(out), rows, inner, at::get_num_threads());
    else
        silu_mul_f32(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner, at::get_num_threads());
    return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> log_softmax_stats(const at::Tensor &x) {
    const char *op = "log_softmax_stats";
    check_cpu(op, {&x});
    CHECK_ARG(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, op,
              ": x must be float32 [rows, vocab > 0] with contiguous rows");
    const int64_t rows = x.size(0);
    at::Tensor largest = at::empty({rows}, x.options()), logsum = at::empty({rows}, x.options());
    at::Tensor at = at::empty({rows}, x.options().dtype(at::kLong));
    log_softmax_stats_f32(x.data_ptr<float>(), rows, x.size(1), x.stride(0), largest.data_ptr<float>(),
                          at.data_ptr<int64_t>(), logsum.data_ptr<float>(), at::get_num_threads());
    return {largest, at, logsum};
}

at::Tensor int8_linear(const at::Tensor &x_arg, const at::Tensor &qweight, const at::Tensor &scales_arg) {
    const char *op = "int8_linear";
    check_cpu(op, {&x_arg, &qweight, &scales_arg});
    CHECK_ARG(x_arg.dim() == 2 && x_arg.size(0) == 1 && x_arg.scalar_type() == at::kBFloat16 &&
                  qweight.scalar_type() == at::kChar && scales_arg.scalar_type() == at::kBFloat16,
              op, ": x must be one bfloat16 row, qweight int8, scales bfloat16");
    CHECK_ARG(qweight.dim() == 2 && x_arg.size(1) == qweight.size(1) && scales_arg.dim() == 1 &&
                  scales_arg.size(0) == qweight.size(0) && qweight.is_contiguous(),
              op, ": x, qweight and scales shapes disagree (or qweight is not contiguous)");
    const at::Tensor x = x_arg.contiguous(), scales = scales_arg.contiguous();
    at::Tensor out = at::empty({1, qweight.size(0)}, x.options());
    int8_linear_bf16(bits(x), x.size(1), qweight.data_ptr<int8_t>(), bits(scales), qweight.size(0), bits(out),
                     at::get_num_threads());
    return out;
}

namespace {

/* The bias of a linear layer of `out_features` rows, if any: bfloat16 [out_features], made contiguous. */
const uint16_t *bias_bits(const char *op, const std::optional<at::Tensor> &bias, int64_t out_features,
                          at::Tensor &holder) {
    if (!bias) return nullptr;
    check_cpu(op, {&*bias});
    CHECK_ARG(bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 && bias->size(0) == out_features, op,
              ": bias must be bfloat16 [out_features]");
    holder = bias->contiguous();
    return bits(holder);
}

}  // namespace

at::Tensor gemv(const at::Tensor &x_arg, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    const char *op = "gemv";
    check_cpu(op, {&x_arg, &weight});
    CHECK_ARG(x_arg.dim() == 2 && x_arg.size(0) == 1 && x_arg.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16,
              op, ": x must be one bfloat16 row, weight and bias bfloat16");
    CHECK_ARG(weight.dim() == 2 && x_arg.size(1) == weight.size(1) && weight.is_contiguous() &&
                  (!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0))),
              op, ": x, weight and bias shapes disagree (or the weight is not contiguous)");
    at::Tensor bias_holder;
    const uint16_t *b = bias_bits(op, bias, weight.size(0), bias_holder);
    const at::Tensor x = x_arg.contiguous();
    at::Tensor out = at::empty({1, weight.size(0)}, x.options());
    bf16_gemv(bits(x), x.size(1), bits(weight), b, weight.size(0), bits(out), at::get_num_threads());
    return out;
}

std::optional<at::Tensor> pack_pairs(const at::Tensor &weight_arg) {
    check_cpu("pack_pairs", {&weight_arg});
    if (!bf16_pairs_supported() || weight_arg.scalar_type() != at::kBFloat16 || weight_arg.dim() != 2 ||
        weight_arg.size(0) % 32 || weight_arg.size(1) % 2)
        return std::nullopt;
    const at::Tensor weight = weight_arg.contiguous();
    at::Tensor pairs = at::empty_like(weight);
    bf16_pack_pairs(bits(weight), weight.size(0), weight.size(1), bits(pairs), at::get_num_threads());
    return pairs;
}

at::Tensor gemm_pairs(const at::Tensor &x_arg, const at::Tensor &pairs, int64_t out_features,
                      const std::optional<at::Tensor> &bias, bool amx) {
    const char *op = "gemm_pairs";
    check_cpu(op, {&x_arg, &pairs});
    CHECK_ARG(bf16_pairs_supported(), op, ": this CPU has no AVX512-BF16, so no pair layout (pack_pairs gives None)");
    CHECK_ARG(x_arg.dim() == 2 && x_arg.scalar_type() == at::kBFloat16 && pairs.scalar_type() == at::kBFloat16 &&
                  pairs.is_contiguous() && out_features % 32 == 0 && x_arg.size(1) % 2 == 0 &&
                  pairs.numel() == out_features * x_arg.size(1),
              op, ": x and the packed weight must be bfloat16 and of agreeing shapes");
    at::Tensor bias_holder;
    const uint16_t *b = bias_bits(op, bias, out_features, bias_holder);
    const at::Tensor x = x_arg.contiguous();
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    if (amx) {
        CHECK_ARG(bf16_pairs_amx_supported(x.size(1)), op,
                  ": amx needs an AMX CPU (that Linux lets use it) and in_features a multiple of 32 (pairs_amx)");
        bf16_gemm_pairs_amx(bits(x), x.size(0), x.size(1), bits(pairs), b, out_features, bits(out),
                            at::get_num_threads());
    } else {
        bf16_gemm_pairs(bits(x), x.size(0), x.size(1), bits(pairs), b, out_features, bits(out),
                        at::get_num_threads());
    }
    return out;
}

bool pairs_amx(int64_t in_features) { return bf16_pairs_amx_supported(in_features) != 0; }

std::optional<at::Tensor> w8a8_pack(const at::Tensor &qweight_arg) {
    const char *op = "w8a8_pack";
    check_cpu(op, {&qweight_arg});
    CHECK_ARG(qweight_arg.scalar_type() == at::kChar && qweight_arg.dim() == 2 && qweight_arg.size(0) > 0 &&
                  qweight_arg.size(1) > 0,
              op, ": qweight must be int8 [out_features, in_features], neither empty");
    if (!w8a8_supported()) return std::nullopt;
    const at::Tensor qweight = qweight_arg.contiguous();
    const int64_t n = qweight.size(0), k = qweight.size(1);
    at::Tensor packed = at::empty({w8a8_packed_bytes(n, k)}, qweight.options());
    ::w8a8_pack(qweight.data_ptr<int8_t>(), n, k, packed.data_ptr<int8_t>(), at::get_num_threads());
    return packed;
}

at::Tensor w8a8_linear(const at::Tensor &x_arg, const at::Tensor &packed, const at::Tensor &scales,
                       int64_t out_features, const std::optional<at::Tensor> &bias_arg, bool silu_mul,
                       bool float_out) {
    const char *op = "w8a8_linear";
    check_cpu(op, {&x_arg, &packed, &scales});
    CHECK_ARG(w8a8_supported(), op, ": this CPU has no AVX512-VNNI, so no packed layout (w8a8_pack gives None)");
    check_float(op, x_arg, {});
    CHECK_ARG(x_arg.dim() == 2 && x_arg.size(1) > 0 && out_features > 0, op, ": x must be [rows, in_features]");
    // Each int32 sum adds in_features products of at most 255 * 127.
    CHECK_ARG(x_arg.size(1) <= 65536, op, ": in_features up to 65536 (int32 sums), not ", x_arg.size(1));
    CHECK_ARG(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
                  w8a8_packed_matches(packed.data_ptr<int8_t>(), packed.size(0), out_features, x_arg.size(1)),
              op, ": packed must be w8a8_pack's int8 tensor for [out_features, x's in_features]");
    CHECK_ARG(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == out_features &&
                  scales.is_contiguous(),
              op, ": scales must be contiguous float32 [out_features]");
    CHECK_ARG(!silu_mul || out_features % 32 == 0, op, ": silu_mul takes out_features in pairs of 16 (gate, up), not ",
              out_features);
    at::Tensor bias;
    if (bias_arg) {
        check_cpu(op, {&*bias_arg});
        check_float(op, x_arg, {&*bias_arg});
        CHECK_ARG(bias_arg->dim() == 1 && bias_arg->size(0) == out_features, op, ": bias must be [out_features]");
        bias = bias_arg->contiguous();
    }
    const at::Tensor x = x_arg.contiguous();
    at::Tensor out = at::empty({x.size(0), silu_mul ? out_features / 2 : out_features},
                               float_out ? x.options().dtype(at::kFloat) : x.options());
    if (x.size(0) == 0) return out;
    ::w8a8_gemm(x.data_ptr(), x.scalar_type() == at::kBFloat16, x.size(0), x.size(1), packed.data_ptr<int8_t>(),
                scales.data_ptr<float>(), bias_arg ? bias.data_ptr() : nullptr, out_features,
                (silu_mul ? W8A8_SILU_MUL : 0) | (float_out ? W8A8_F32_OUT : 0), out.data_ptr(), at::get_num_threads());
    return out;
}

bool w8a8_use_amx(std::optional<bool> enable) { return ::w8a8_use_amx(enable ? int(*enable) : -1) != 0; }

bool attention_use_amx(std::optional<bool> enable) {
    return ::decode_scores_use_amx(enable ? int(*enable) : -1) != 0;
}

}  // namespace servelm

TORCH_LIBRARY_FRAGMENT(servelm, m) {
    m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor lens, float scale) -> Tensor?");
    m.def("prefill_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
          "Tensor(a!) out) -> bool");
    m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
    m.def("rope_(Tensor(a!) x, int heads, int head_dim, Tensor cos_sin, Tensor positions) -> ()");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("log_softmax_stats(Tensor x) -> (Tensor, Tensor, Tensor)");
    m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
    m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
    m.def("pack_pairs(Tensor weight) -> Tensor?");
    m.def("gemm_pairs(Tensor x, Tensor pairs, int out_features, Tensor? bias=None, bool amx=False) -> Tensor");
    m.def("pairs_amx(int in_features) -> bool", &servelm::pairs_amx);  // no tensor: every backend
    m.def("w8a8_pack(Tensor qweight) -> Tensor?");
    m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias=None, "
          "bool silu_mul=False, bool float_out=False) -> Tensor");
    m.def("w8a8_use_amx(bool? enable=None) -> bool", &servelm::w8a8_use_amx);  // no tensor: every backend
    m.def("attention_use_amx(bool? enable=None) -> bool", &servelm::attention_use_amx);
}

TORCH_LIBRARY_IMPL(servelm, CPU, m) {
    m.impl("decode_attention", &servelm::decode_attention);
    m.impl("prefill_attention", &servelm::prefill_attention);
    m.impl("write_kv", &servelm::write_kv);
    m.impl("rms_norm", &servelm::rms_norm);
    m.impl("rope_", &servelm::rope_);
    m.impl("silu_mul", &servelm::silu_mul);
    m.impl("log_softmax_stats", &servelm::log_softmax_stats);
    m.impl("int8_linear", &servelm::int8_linear);
    m.impl("gemv", &servelm::gemv);
    m.impl("pack_pairs", &servelm::pack_pairs);
    m.impl("gemm_pairs", &servelm::gemm_pairs);
    m.impl("w8a8_pack", &servelm::w8a8_pack);
    m.impl("w8a8_linear", &servelm::w8a8_linear);
}
