/* decode_step.c's one-call decoding step as a PyTorch op, servelm::decode_step,
 * over a servelm.Decoder: a custom class that checks a model's weights and
 * caches once, when it is made, and holds them for as long as it lives, so
 * the pointers the C step follows stay valid. Each call checks its tokens,
 * positions and block tables. Built at first use by servelm/kernels/build.py. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "checks.h"
#include "kernels.h"

namespace servelm {

namespace {

constexpr const char *kOp = "decoding step";
constexpr int64_t kTensorsPerLayer = 15;  // input_norm, post_norm, kv_cache, then weight, scales, bias of 4 linears
constexpr int64_t kIntsPerLinear = 4;     // kind, vector_rows, max_rows, silu_mul
constexpr const char *kLinears[] = {"qkv", "o", "gate_up", "down"};

/* A tensor on the CPU, contiguous, of this dtype and these sizes. */
void check_tensor(const at::Tensor &t, const char *what, at::ScalarType dtype, at::IntArrayRef sizes) {
    CHECK_ARG(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, kOp, ": ", what,
              " must be contiguous ", dtype, " on the CPU");
    CHECK_ARG(t.sizes() == sizes, kOp, ": ", what, " has shape ", t.sizes(), ", expected ", sizes);
}

}  // namespace

struct Decoder : torch::CustomClassHolder {
    std::vector<at::Tensor> keep;  // every tensor the C step reads
    std::vector<decoder_layer> layers;
    ::decoder spec{};
    int64_t num_blocks = 0, positions = 0;
    int64_t max_rows = INT64_MAX;  // the most rows every linear layer takes

    /* `tensors`: kTensorsPerLayer per layer, in decoder_layer's order (scales and biases may be None);
     * `layouts`: per layer, kIntsPerLinear per linear, as struct linear has them (max_rows: the most rows it
     * takes); `intermediate`: the MLP's inner size (w8a8's packed weights do not show it). */
    Decoder(const c10::List<std::optional<at::Tensor>> &tensors, const std::vector<int64_t> &layouts,
            const at::Tensor &final_norm, const at::Tensor &cos_sin, int64_t heads, int64_t intermediate, double eps,
            double scale) {
        const int64_t num_layers = static_cast<int64_t>(tensors.size()) / kTensorsPerLayer;
        CHECK_ARG(num_layers > 0 && static_cast<int64_t>(tensors.size()) == num_layers * kTensorsPerLayer &&
                      static_cast<int64_t>(layouts.size()) == 4 * kIntsPerLinear * num_layers,
                  kOp, ": ", kTensorsPerLayer, " tensors and ", 4 * kIntsPerLinear,
                  " layout numbers per layer expected");
        const at::Tensor cache = required(tensors, 2, "kv_cache");
        CHECK_ARG(final_norm.dim() == 1 && cache.dim() == 5 && cache.size(0) == 2 && cache.size(2) > 0, kOp,
                  ": final_norm [hidden] and kv_cache [2, blocks, block_size, kv_heads, head_dim] expected");
        const int64_t hidden = final_norm.size(0), block_size = cache.size(2), kv_heads = cache.size(3);
        const bool int8 = kv_int8(cache);
        const int64_t head_dim = cache_head_dim(cache);
        CHECK_ARG(head_dim > 0 && (!int8 || ::kv_int8_decodes(head_dim)), kOp,
                  ": an int8 cache needs its decode kernel (AVX512-BF16, head_dim a multiple of 64)");
        CHECK_ARG(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, kOp, ": ", heads, " heads over ", kv_heads,
                  " KV heads");
        CHECK_ARG(intermediate > 0, kOp, ": intermediate must be positive");
        check_tensor(final_norm, "the final norm's weight", at::kBFloat16, {hidden});
        CHECK_ARG(cos_sin.device().is_cpu() && cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                      cos_sin.dim() == 2 && cos_sin.size(1) == head_dim,
                  kOp, ": cos_sin must be contiguous float32 [positions, head_dim]");
        const int64_t shapes[4][2] = {{(heads + 2 * kv_heads) * head_dim, hidden}, {hidden, heads * head_dim},
                                      {2 * intermediate, hidden}, {hidden, intermediate}};
        keep = {final_norm, cos_sin};
        for (int64_t i = 0; i < num_layers; i++) {
            const int64_t first = i * kTensorsPerLayer;
            decoder_layer layer{};
            const at::Tensor input_norm = required(tensors, first, "input_norm");
            const at::Tensor post_norm = required(tensors, first + 1, "post_norm");
            const at::Tensor kv_cache = required(tensors, first + 2, "kv_cache");
            check_tensor(input_norm, "input_norm", at::kBFloat16, {hidden});
            check_tensor(post_norm, "post_norm", at::kBFloat16, {hidden});
            CHECK_ARG(kv_cache.device().is_cpu() && kv_cache.is_contiguous() &&
                          kv_cache.scalar_type() == (int8 ? at::kChar : at::kBFloat16) &&
                          kv_cache.sizes() == cache.sizes(),
                      kOp,
                      ": every layer's kv_cache must be contiguous on the CPU, of the first one's dtype and shape");
            layer.input_norm = bits(input_norm);
            layer.post_norm = bits(post_norm);
            layer.k_cache = kv_cache[0].data_ptr();
            layer.v_cache = kv_cache[1].data_ptr();
            keep.insert(keep.end(), {input_norm, post_norm, kv_cache});
            linear *linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
            for (int j = 0; j < 4; j++)
                *linears[j] = make_linear(tensors, first + 3 + 3 * j, kLinears[j],
                                          layouts.data() + (4 * i + j) * kIntsPerLinear, shapes[j], j == 2);
            layers.push_back(layer);
        }
        spec = ::decoder{num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, int8,
                         static_cast<float>(eps), static_cast<float>(scale), cos_sin.data_ptr<float>(),
                         bits(final_norm), layers.data()};
        num_blocks = cache.size(1);
        positions = cos_sin.size(0);
    }

  private:
    static at::Tensor required(const c10::List<std::optional<at::Tensor>> &tensors, int64_t index, const char *what) {
        std::optional<at::Tensor> t = tensors.get(index);
        CHECK_ARG(t.has_value(), kOp, ": ", what, " is missing");
        return *t;
    }

    /* A linear layer's weight, scales and bias as its layout (kind, vector_rows, max_rows, silu_mul) has them:
     * see struct linear. */
    linear make_linear(const c10::List<std::optional<at::Tensor>> &tensors, int64_t first, const char *name,
                       const int64_t *layout, const int64_t (&shape)[2], bool gate_up) {
        const at::Tensor weight = required(tensors, first, name);
        const std::optional<at::Tensor> scales = tensors.get(first + 1), bias = tensors.get(first + 2);
        const int64_t kind = layout[0], vector_rows = layout[1], rows = layout[2], silu = layout[3];
        const int64_t N = shape[0], K = shape[1];
        CHECK_ARG(kind >= LINEAR_PLAIN && kind <= LINEAR_W8A8 && rows >= 1, kOp, ": ", name, " has no layout ",
                  kind, " for ", rows, " rows");
        CHECK_ARG(weight.device().is_cpu() && weight.is_contiguous(), kOp, ": ", name,
                  " must be contiguous on the CPU");
        CHECK_ARG(!silu || (gate_up && kind == LINEAR_W8A8 && N % 32 == 0), kOp, ": ", name,
                  " cannot write silu_mul's result");
        switch (kind) {
        case LINEAR_W8A8:
            CHECK_ARG(w8a8_supported() && weight.scalar_type() == at::kChar && weight.dim() == 1 &&
                          w8a8_packed_matches(weight.data_ptr<int8_t>(), weight.numel(), N, K),
                      kOp, ": ", name, " must be int8 packed by w8a8_pack for [", N, ", ", K, "]");
            CHECK_ARG(scales.has_value(), kOp, ": ", name, " needs its float32 scales");
            check_tensor(*scales, "scales", at::kFloat, {N});
            break;
        case LINEAR_INT8:
            CHECK_ARG(weight.scalar_type() == at::kChar && scales.has_value() && rows == 1, kOp, ": ", name,
                      " must be int8 with scales, for one row");
            check_tensor(*scales, "scales", at::kBFloat16, {N});
            break;
        default:
            CHECK_ARG(weight.scalar_type() == at::kBFloat16 && !scales.has_value(), kOp, ": ", name,
                      " must be bfloat16, or int8 with scales");
            CHECK_ARG(kind != LINEAR_PAIRS || (bf16_pairs_supported() && N % 32 == 0 && K % 2 == 0), kOp, ": ",
                      name, " cannot be in the pair layout");
            CHECK_ARG(kind != LINEAR_PAIRS || rows <= vector_rows || bf16_pairs_amx_supported(K), kOp, ": ", name,
                      " takes ", rows, " rows, past ", vector_rows, " on AMX tiles, which do not run here");
        }
        if (kind != LINEAR_W8A8)
            CHECK_ARG(weight.sizes() == at::IntArrayRef(shape), kOp, ": ", name, " has shape ", weight.sizes(),
                      ", expected ", at::IntArrayRef(shape));
        keep.push_back(weight);
        linear l{weight.data_ptr(), nullptr, nullptr, kind, vector_rows, silu};
        if (scales) {
            keep.push_back(*scales);
            l.scales = scales->data_ptr();
        }
        if (bias) {
            check_tensor(*bias, "bias", at::kBFloat16, {N});
            keep.push_back(*bias);
            l.bias = bits(*bias);
        }
        max_rows = std::min(max_rows, rows);
        return l;
    }
};

/* x [rows, hidden]: the tokens' embeddings, overwritten with their final hidden states; token r sits at
 * positions[r] of the sequence whose block table block_tables[r] (int64 [rows, max_blocks]) covers it. */
void decode_step(const c10::intrusive_ptr<Decoder> &self, at::Tensor x, const at::Tensor &positions_arg,
                 const at::Tensor &block_tables) {
    const ::decoder &m = self->spec;
    CHECK_ARG(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) == m.hidden && x.size(0) >= 1,
              kOp, ": x must be contiguous bfloat16 rows of the hidden size");
    const int64_t rows = x.size(0);
    CHECK_ARG(rows <= self->max_rows, kOp, ": ", rows, " rows, past the ", self->max_rows,
              " its linear layers take");
    CHECK_ARG(positions_arg.device().is_cpu() && positions_arg.scalar_type() == at::kLong &&
                  positions_arg.dim() == 1 && positions_arg.size(0) == rows,
              kOp, ": positions must be int64 [rows]");
    CHECK_ARG(block_tables.device().is_cpu() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == rows,
              kOp, ": the block tables must be int64 [rows, max_blocks]");
    const at::Tensor positions = positions_arg.contiguous(), tables = block_tables.contiguous();
    const int64_t max_blocks = tables.size(1);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t position = positions.data_ptr<int64_t>()[r];
        CHECK_ARG(position >= 0 && position < max_blocks * m.block_size, kOp, ": position ", position,
                  " is not covered by its block table of ", max_blocks, " blocks");
        CHECK_ARG(position < self->positions, kOp, ": position ", position, " is past the model's ", self->positions);
        check_table(kOp, tables.data_ptr<int64_t>() + r * max_blocks, position + 1, m.block_size, self->num_blocks);
    }
    decode_step_bf16(&m, bits(x), rows, positions.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), max_blocks,
                     at::get_num_threads());
}

}  // namespace servelm

TORCH_LIBRARY_FRAGMENT(servelm, m) {
    m.class_<servelm::Decoder>("Decoder")
        .def(torch::init<const c10::List<std::optional<at::Tensor>> &, const std::vector<int64_t> &,
                         const at::Tensor &, const at::Tensor &, int64_t, int64_t, double, double>())
        .def("max_rows", [](const c10::intrusive_ptr<servelm::Decoder> &self) { return self->max_rows; });
    m.def("decode_step(__torch__.torch.classes.servelm.Decoder decoder, Tensor(a!) x, Tensor positions, "
          "Tensor block_tables) -> ()");
}

TORCH_LIBRARY_IMPL(servelm, CPU, m) { m.impl("decode_step", &servelm::decode_step); }
