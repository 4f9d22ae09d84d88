/* decode_one.c's one-call decoding step as a PyTorch op, servelm::decode_one,
 * over a servelm.OneTokenDecoder: a custom class that checks a model's
 * weights and caches once, when it is made, and holds them for as long as it
 * lives, so the pointers the C step follows stay valid. Each call checks its
 * token, position and block table. Built at first use by
 * servelm/kernels/build.py. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "kernels.h"

namespace servelm {

namespace {

constexpr const char *kOp = "one-token decoder";
constexpr int64_t kTensorsPerLayer = 15;  // input_norm, post_norm, kv_cache, then weight, scales, bias of 4 linears
constexpr const char *kLinears[] = {"qkv", "o", "gate_up", "down"};

/* A bfloat16 tensor on the CPU, contiguous, of these sizes. */
void check_bf16(const at::Tensor &t, const char *what, at::IntArrayRef sizes) {
    CHECK_ARG(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kBFloat16, kOp, ": ", what,
              " must be contiguous bfloat16 on the CPU");
    CHECK_ARG(t.sizes() == sizes, kOp, ": ", what, " has shape ", t.sizes(), ", expected ", sizes);
}

}  // namespace

struct OneTokenDecoder : torch::CustomClassHolder {
    std::vector<at::Tensor> keep;  // every tensor the C step reads
    std::vector<decoder_layer> layers;
    ::decoder spec{};
    int64_t num_blocks = 0, positions = 0;

    /* `tensors`: kTensorsPerLayer per layer, in decoder_layer's order (scales and biases may be None);
     * `pairs`: per layer, whether each linear's bfloat16 weight is in the pair layout. */
    OneTokenDecoder(const c10::List<std::optional<at::Tensor>> &tensors, const std::vector<int64_t> &pairs,
                    const at::Tensor &final_norm, const at::Tensor &cos_sin, int64_t heads, double eps, double scale) {
        const int64_t num_layers = static_cast<int64_t>(tensors.size()) / kTensorsPerLayer;
        CHECK_ARG(num_layers > 0 && static_cast<int64_t>(tensors.size()) == num_layers * kTensorsPerLayer &&
                      static_cast<int64_t>(pairs.size()) == 4 * num_layers,
                  kOp, ": ", kTensorsPerLayer, " tensors and 4 pair flags per layer expected");
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
        const at::Tensor down = required(tensors, 3 + 3 * 3, "down");
        CHECK_ARG(down.dim() == 2, kOp, ": down must be [hidden, intermediate]");
        const int64_t intermediate = down.size(1);
        const int64_t shapes[4][2] = {{(heads + 2 * kv_heads) * head_dim, hidden}, {hidden, heads * head_dim},
                                      {2 * intermediate, hidden}, {hidden, intermediate}};
        check_bf16(final_norm, "the final norm's weight", {hidden});
        CHECK_ARG(cos_sin.device().is_cpu() && cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                      cos_sin.dim() == 2 && cos_sin.size(1) == head_dim,
                  kOp, ": cos_sin must be contiguous float32 [positions, head_dim]");
        keep = {final_norm, cos_sin};
        for (int64_t i = 0; i < num_layers; i++) {
            const int64_t first = i * kTensorsPerLayer;
            decoder_layer layer{};
            const at::Tensor input_norm = required(tensors, first, "input_norm");
            const at::Tensor post_norm = required(tensors, first + 1, "post_norm");
            const at::Tensor kv_cache = required(tensors, first + 2, "kv_cache");
            check_bf16(input_norm, "input_norm", {hidden});
            check_bf16(post_norm, "post_norm", {hidden});
            CHECK_ARG(kv_cache.device().is_cpu() && kv_cache.is_contiguous() &&
                          kv_cache.scalar_type() == (int8 ? at::kChar : at::kBFloat16) &&
                          kv_cache.sizes() == cache.sizes(),
                      kOp, ": every layer's kv_cache must be contiguous on the CPU, of the first one's dtype and shape");
            layer.input_norm = bits(input_norm);
            layer.post_norm = bits(post_norm);
            layer.k_cache = kv_cache[0].data_ptr();
            layer.v_cache = kv_cache[1].data_ptr();
            keep.insert(keep.end(), {input_norm, post_norm, kv_cache});
            linear *linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
            for (int j = 0; j < 4; j++)
                *linears[j] = make_linear(tensors, first + 3 + 3 * j, kLinears[j], pairs[4 * i + j] != 0, shapes[j]);
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

    /* A linear layer's weight (bfloat16, plain or in the pair layout, or int8 with scales), scales and bias. */
    linear make_linear(const c10::List<std::optional<at::Tensor>> &tensors, int64_t first, const char *name,
                       bool pairs, const int64_t (&shape)[2]) {
        const at::Tensor weight = required(tensors, first, name);
        const std::optional<at::Tensor> scales = tensors.get(first + 1), bias = tensors.get(first + 2);
        const bool int8 = weight.scalar_type() == at::kChar;
        CHECK_ARG((weight.scalar_type() == at::kBFloat16 || int8) && scales.has_value() == int8, kOp, ": ", name,
                  " must be bfloat16, or int8 with scales");
        CHECK_ARG(weight.sizes() == at::IntArrayRef(shape), kOp, ": ", name, " has shape ", weight.sizes(),
                  ", expected ", at::IntArrayRef(shape));
        CHECK_ARG(weight.device().is_cpu() && weight.is_contiguous(), kOp, ": ", name,
                  " must be contiguous on the CPU");
        CHECK_ARG(!pairs || (!int8 && bf16_pairs_supported() && shape[0] % 32 == 0 && shape[1] % 2 == 0), kOp, ": ",
                  name, " cannot be in the pair layout");
        keep.push_back(weight);
        linear l{weight.data_ptr(), nullptr, nullptr, pairs};
        if (scales) {
            check_bf16(*scales, "scales", {shape[0]});
            keep.push_back(*scales);
            l.scales = bits(*scales);
        }
        if (bias) {
            check_bf16(*bias, "bias", {shape[0]});
            keep.push_back(*bias);
            l.bias = bits(*bias);
        }
        return l;
    }
};

/* x [1, hidden]: the token's embedding, overwritten with the final hidden state; the token sits at `position`
 * of the sequence whose block table (int64 [blocks]) covers it. */
void decode_one(const c10::intrusive_ptr<OneTokenDecoder> &self, at::Tensor x, int64_t position,
                const at::Tensor &block_table) {
    const ::decoder &m = self->spec;
    CHECK_ARG(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                  x.size(0) == 1 && x.size(1) == m.hidden,
              kOp, ": x must be one contiguous bfloat16 row of the hidden size");
    CHECK_ARG(block_table.device().is_cpu() && block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
                  position >= 0 && block_table.size(0) * m.block_size > position,
              kOp, ": the block table must be int64 [blocks] and cover the position");
    CHECK_ARG(position < self->positions, kOp, ": position ", position, " is past the model's ",
              self->positions);
    const at::Tensor table = block_table.contiguous();
    check_table(kOp, table.data_ptr<int64_t>(), position + 1, m.block_size, self->num_blocks);
    decode_one_bf16(&m, bits(x), position, table.data_ptr<int64_t>(), at::get_num_threads());
}

}  // namespace servelm

TORCH_LIBRARY_FRAGMENT(servelm, m) {
    m.class_<servelm::OneTokenDecoder>("OneTokenDecoder")
        .def(torch::init<const c10::List<std::optional<at::Tensor>> &, const std::vector<int64_t> &,
                         const at::Tensor &, const at::Tensor &, int64_t, double, double>());
    m.def("decode_one(__torch__.torch.classes.servelm.OneTokenDecoder decoder, Tensor(a!) x, int position, "
          "Tensor block_table) -> ()");
}

TORCH_LIBRARY_IMPL(servelm, CPU, m) { m.impl("decode_one", &servelm::decode_one); }
