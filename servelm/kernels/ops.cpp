/* servelm's C kernels as PyTorch ops (namespace servelm), each with a schema.
 *
 * The kernels read raw pointers and trust them; every op here checks what
 * its kernel will read first (device, dtype, shape, strides, and the slots,
 * positions and block-table entries it will index with) and raises
 * ValueError instead of calling C. Registered through the dispatcher, the ops
 * show by name in torch.profiler. The attention ops and the KV cache's
 * writes are in attention_op.cpp, the one-token decoder in decoder_op.cpp.
 * Built at first use by servelm/kernels/build.py. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

namespace servelm {

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> draw(const at::Tensor &x, const at::Tensor &scale, const at::Tensor &top_k,
                                                    const at::Tensor &top_p, const at::Tensor &min_p, const at::Tensor &u) {
    const char *op = "draw";
    check_cpu(op, {&x, &scale, &top_k, &top_p, &min_p, &u});
    CHECK_ARG(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, op,
              ": x must be float32 [rows, vocab > 0] with contiguous rows");
    const int64_t rows = x.size(0);
    for (const at::Tensor *t : {&scale, &top_k, &top_p, &min_p, &u})
        CHECK_ARG(t->scalar_type() == (t == &top_k ? at::kLong : at::kFloat) && t->dim() == 1 && t->size(0) == rows &&
                      t->is_contiguous(),
                  op, ": scale, top_p, min_p and u must be contiguous float32 [rows], top_k int64 [rows]");
    at::Tensor token = at::empty({rows}, x.options().dtype(at::kLong));
    at::Tensor largest = at::empty({rows}, x.options()), logsum = at::empty({rows}, x.options());
    draw_f32(x.data_ptr<float>(), rows, x.size(1), x.stride(0), scale.data_ptr<float>(), top_k.data_ptr<int64_t>(),
             top_p.data_ptr<float>(), min_p.data_ptr<float>(), u.data_ptr<float>(), token.data_ptr<int64_t>(),
             largest.data_ptr<float>(), logsum.data_ptr<float>(), at::get_num_threads());
    return {token, largest, logsum};
}

std::tuple<at::Tensor, at::Tensor> top_values(const at::Tensor &x, const at::Tensor &rows, int64_t k) {
    const char *op = "top_values";
    check_cpu(op, {&x, &rows});
    CHECK_ARG(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, op,
              ": x must be float32 [rows, vocab > 0] with contiguous rows");
    CHECK_ARG(k >= 0 && k <= x.size(1), op, ": k must be in [0, vocab]");
    CHECK_ARG(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), op,
              ": rows must be contiguous int64 [n]");
    const int64_t n = rows.size(0), *at_rows = rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; r++) CHECK_ARG(at_rows[r] >= 0 && at_rows[r] < x.size(0), op, ": rows out of range");
    at::Tensor values = at::empty({n, k}, x.options()), ids = at::empty({n, k}, x.options().dtype(at::kLong));
    top_values_f32(x.data_ptr<float>(), x.size(1), x.stride(0), at_rows, n, k, values.data_ptr<float>(),
                   ids.data_ptr<int64_t>(), at::get_num_threads());
    return {values, ids};
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
    const bool f32 = x_arg.scalar_type() == at::kFloat;
    CHECK_ARG(x_arg.dim() == 2 && (f32 || x_arg.scalar_type() == at::kBFloat16) &&
                  weight.scalar_type() == x_arg.scalar_type(),
              op, ": x must be rows [M, in_features], bfloat16 or float32, and the weight (and bias) of its dtype");
    CHECK_ARG(weight.dim() == 2 && x_arg.size(1) == weight.size(1) && weight.is_contiguous() &&
                  (!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0))),
              op, ": x, weight and bias shapes disagree (or the weight is not contiguous)");
    const at::Tensor x = x_arg.contiguous();
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    at::Tensor bias_holder;
    if (f32) {
        if (bias) {
            check_cpu(op, {&*bias});
            CHECK_ARG(bias->scalar_type() == at::kFloat, op, ": bias must be of x's dtype");
            bias_holder = bias->contiguous();
        }
        f32_gemv(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(),
                 bias ? bias_holder.data_ptr<float>() : nullptr, weight.size(0), out.data_ptr<float>(),
                 at::get_num_threads());
        return out;
    }
    const uint16_t *b = bias_bits(op, bias, weight.size(0), bias_holder);
    bf16_gemv(bits(x), x.size(0), x.size(1), bits(weight), b, weight.size(0), bits(out), at::get_num_threads());
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
    CHECK_ARG(x_arg.dim() == 2 && x_arg.scalar_type() == at::kBFloat16 && pairs.scalar_type() == at::kBFloat16 &&
                  pairs.is_contiguous() && out_features % 32 == 0 && x_arg.size(1) % 2 == 0 &&
                  pairs.numel() == out_features * x_arg.size(1),
              op, ": x and the packed weight must be bfloat16 and of agreeing shapes");
    at::Tensor bias_holder;
    const uint16_t *b = bias_bits(op, bias, out_features, bias_holder);
    // After the arguments' own checks, so that a caller's mistake reads the same on every CPU.
    CHECK_ARG(bf16_pairs_supported(), op, ": this CPU has no AVX512-BF16, so no pair layout (pack_pairs gives None)");
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
                (silu_mul ? W8A8_SILU_MUL : 0) | (float_out ? W8A8_F32_OUT : 0), out.data_ptr(), at::get_num_threads(),
                nullptr);
    return out;
}

bool w8a8_use_amx(std::optional<bool> enable) { return ::w8a8_use_amx(enable ? int(*enable) : -1) != 0; }

}  // namespace servelm

TORCH_LIBRARY_FRAGMENT(servelm, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
    m.def("rope_(Tensor(a!) x, int heads, int head_dim, Tensor cos_sin, Tensor positions) -> ()");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    m.def("log_softmax_stats(Tensor x) -> (Tensor, Tensor, Tensor)");
    m.def("draw(Tensor x, Tensor scale, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> (Tensor, Tensor, Tensor)");
    m.def("top_values(Tensor x, Tensor rows, int k) -> (Tensor, Tensor)");
    m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
    m.def("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
    m.def("pack_pairs(Tensor weight) -> Tensor?");
    m.def("gemm_pairs(Tensor x, Tensor pairs, int out_features, Tensor? bias=None, bool amx=False) -> Tensor");
    m.def("pairs_amx(int in_features) -> bool", &servelm::pairs_amx);  // no tensor: every backend
    m.def("w8a8_pack(Tensor qweight) -> Tensor?");
    m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias=None, "
          "bool silu_mul=False, bool float_out=False) -> Tensor");
    m.def("w8a8_use_amx(bool? enable=None) -> bool", &servelm::w8a8_use_amx);  // no tensor: every backend
}

TORCH_LIBRARY_IMPL(servelm, CPU, m) {
    m.impl("rms_norm", &servelm::rms_norm);
    m.impl("rope_", &servelm::rope_);
    m.impl("silu_mul", &servelm::silu_mul);
    m.impl("log_softmax_stats", &servelm::log_softmax_stats);
    m.impl("draw", &servelm::draw);
    m.impl("top_values", &servelm::top_values);
    m.impl("int8_linear", &servelm::int8_linear);
    m.impl("gemv", &servelm::gemv);
    m.impl("pack_pairs", &servelm::pack_pairs);
    m.impl("gemm_pairs", &servelm::gemm_pairs);
    m.impl("w8a8_pack", &servelm::w8a8_pack);
    m.impl("w8a8_linear", &servelm::w8a8_linear);
}
