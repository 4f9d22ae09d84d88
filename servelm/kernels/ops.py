"""The typed Python face of servelm's CPU kernels: one method per op of ``torch.ops.servelm``.

The ops are registered in C++ (``ops.cpp``, ``attention_op.cpp``, ``decoder_op.cpp``) with
schemas, check every argument before their kernel reads it (a wrong dtype,
device, shape, stride, contiguity or index raises ValueError) and show by
name (``servelm::rms_norm`` ...) in ``torch.profiler``. This class only names
them and documents what each takes; it exists once the library is loaded
(``servelm.kernels.cpu_kernels``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_DTYPES = (torch.bfloat16, torch.float32)


LINEAR_KINDS = ("plain", "pairs", "int8", "w8a8")  # kernels.h's enum linear_kind, in its order


class LinearWeights(NamedTuple):
    """What the native decoding step reads of a linear layer ``[out, in]`` for the rows it decodes, by
    ``kind``: ``plain``, a bfloat16 weight (one row); ``pairs``, the same in ``pack_pairs``'s layout, up to
    ``vector_rows`` rows on the vector unit and more on AMX tiles; ``int8``, int8 rows with bfloat16
    ``scales`` ``[out]`` (one row); ``w8a8``, ``w8a8_pack``'s layout with float32 ``scales`` ``[out]``, and
    with ``silu_mul`` a gate/up weight in pairs of 16-row blocks whose product's ``silu_mul`` is written
    instead. ``max_rows``: the most rows the layer takes this way; ``bias`` ``[out]`` bfloat16 or None."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    kind: str = "plain"
    vector_rows: int = 1
    max_rows: int = 1
    silu_mul: bool = False


class DecoderLayerWeights(NamedTuple):
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearWeights  # q heads, then k, then v
    o: LinearWeights
    gate_up: LinearWeights  # gate rows, then up
    down: LinearWeights
    kv_cache: torch.Tensor  # [2, blocks, block_size, kv_heads, head_dim] bfloat16, or int8 rows of head_dim + 4


class DecodingStep:
    """A decoding step of a batch of sequences, one token each, through every layer in one op
    (``servelm::decode_step``).

    Wraps a ``torch.classes.servelm.Decoder``, which checked the weights and
    caches when it was made and holds them, so they outlive it.
    """

    def __init__(self, native: torch.ScriptObject) -> None:
        self._decoder = native  # the C++ object holding the weights and caches
        self._op = torch.ops.servelm.decode_step.default
        self.max_rows: int = native.max_rows()  # the most rows (sequences) a call takes

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[rows, hidden]`` of the tokens whose embeddings are ``x`` ``[rows,
        hidden]`` (overwritten), token r at ``positions[r]`` of the sequence whose block table
        ``block_tables[r]`` (int64 ``[rows, max_blocks]``) covers it."""
        self._op(self._decoder, x, positions, block_tables)
        return x


class CpuKernels:
    """The loaded ops, for bfloat16 and float32 CPU tensors (some bfloat16 only, as each says)."""

    def __init__(self) -> None:
        ops = torch.ops.servelm
        self._decode_attention = ops.decode_attention.default
        self._prefill_attention = ops.prefill_attention.default
        self._write_kv = ops.write_kv.default
        self._rms_norm = ops.rms_norm.default
        self._rope = ops.rope_.default
        self._silu_mul = ops.silu_mul.default
        self._log_softmax_stats = ops.log_softmax_stats.default
        self._draw = ops.draw.default
        self._top_values = ops.top_values.default
        self._int8_linear = ops.int8_linear.default
        self._gemv = ops.gemv.default
        self._pack_pairs = ops.pack_pairs.default
        self._gemm_pairs = ops.gemm_pairs.default
        self._pairs_amx = ops.pairs_amx.default
        self._w8a8_pack = ops.w8a8_pack.default
        self._w8a8_linear = ops.w8a8_linear.default
        self._w8a8_use_amx = ops.w8a8_use_amx.default
        self._attention_use_amx = ops.attention_use_amx.default

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        """Whether these tensors can go to the kernels: CPU, one dtype, bfloat16 or float32."""
        dtype = tensors[0].dtype
        return dtype in _DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)

    @staticmethod
    def supports_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the attention ops take ``x`` (queries, or keys to write) with ``kv_cache``: as ``supports``,
        or an int8 cache (``layers.kv_int8``) with bfloat16 ``x``."""
        if kv_cache.dtype == torch.int8:
            return x.dtype == torch.bfloat16 and x.device.type == kv_cache.device.type == "cpu"
        return CpuKernels.supports(x, kv_cache)

    def decode_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """One query token per sequence over the paged cache.

        ``query`` ``[B, H, D]`` (each token's heads contiguous; the token axis
        may be strided, as in a view of the fused QKV output); ``kv_cache``
        ``[2, blocks, block_size, KVH, D]`` contiguous, of the query's dtype,
        or int8 (``[..., D + 4]``, ``layers.kv_int8``); ``block_tables``
        ``[B, max_blocks]`` int64; ``lens`` ``[B]`` int64, each in
        ``[1, max_blocks * block_size]``. Returns ``[B, H, D]`` contiguous;
        None where an int8 cache's kernel does not run (a float32 query, no
        AVX512-BF16, D not a multiple of 64).
        """
        return self._decode_attention(query, kv_cache, block_tables, lens, scale)

    def decodes_int8_cache(self, head_dim: int) -> bool:
        """Whether ``decode_attention`` runs natively over an int8 cache of ``head_dim``-dim heads
        (AVX512-BF16, ``head_dim`` a multiple of 64), as the one-call decoding step needs; a one-token probe."""
        probe = self._decode_attention(
            torch.zeros(1, 1, head_dim, dtype=torch.bfloat16),
            torch.zeros(2, 1, 1, 1, head_dim + 4, dtype=torch.int8),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
        )
        return probe is not None

    def prefill_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> bool:
        """Causal attention of prefilling sequences over the cache (of the query's dtype, or int8), into
        ``out``; False where the kernel does not apply (not bfloat16, no AVX512-BF16, head dims not a multiple
        of 64): ``out`` is then untouched.

        ``query`` ``[T, H, D]`` holds the sequences' new tokens one after the other (each token's heads
        contiguous; the token axis may be strided); their K/V are already in ``kv_cache``. ``seq_lens``
        ``[3, S]`` int64: each sequence's first row in ``query``, its new tokens, and its context (cached
        tokens + new); ``block_tables`` ``[S, max_blocks]``. ``out`` contiguous, ``[T', H, D]`` with
        ``T' >= T``: the sequences' rows are written, any after them left alone.
        """
        return self._prefill_attention(query, kv_cache, block_tables, seq_lens, scale, out)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """``kv_cache[0]``'s and ``kv_cache[1]``'s flat slot ``slots[t]`` = token t's ``key`` and ``value``
        ``[T, kv_heads, head_dim]`` (each token's heads contiguous; the token axis may be strided, as in views
        of the fused QKV output, the same for both), as ``attention.write_kv_cache`` does; into an int8 cache,
        each row rounded as ``layers.kv_int8.quantize_rows`` does."""
        self._write_kv(kv_cache, key, value, slots)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x`` ``[..., hidden]`` (contiguous), as ``layers.norm.RMSNorm`` computes it.

        With ``residual`` (same shape, contiguous), first ``residual += x`` in
        place, rounded to the dtype, and the norm is taken of the new residual.
        """
        return self._rms_norm(x, weight, eps, residual)

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate-half RoPE in place on the first ``heads`` heads of each row of ``x`` ``[T, width]``.

        The rows may be strided (a fused QKV output's q and k part); ``cos_sin``
        ``[max_positions, head_dim]`` float32, cos then sin; ``positions`` ``[T]`` int64.
        """
        self._rope(x, heads, head_dim, cos_sin, positions)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[..., 2 * inner]`` (contiguous), as ``layers.activation`` computes
        it."""
        return self._silu_mul(gate_up)

    def log_softmax_stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(largest, index, logsum)`` per row of float32 ``x`` ``[rows, vocab]`` (rows contiguous) in one
        pass, without writing a ``[rows, vocab]`` result: ``log_softmax(x) = x - largest - logsum``.
        ``largest`` and ``index`` are ``x.max(dim=-1)``'s (a NaN counts as largest); ``logsum`` is
        ``log(sum(exp(x - largest)))``, NaN where ``largest`` is not finite, as the log-softmax row then is."""
        return self._log_softmax_stats(x)

    def draw(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row of float32 ``x`` ``[rows, vocab]`` (rows contiguous), drawn with the uniform number
        ``u`` (in [0, 1)) from ``softmax(x * scale[:, None])`` after top-k, top-p and min-p, as the sampler's
        PyTorch stages and ``row_blocks.inverse_cdf`` draw it: the first index whose running sum of the kept
        probabilities exceeds ``u`` times their total, never a token of probability 0. ``top_k`` (int64) <= 0 or
        >= vocab, ``top_p`` >= 1 and ``min_p`` <= 0 leave a row whole; the others are float32, all ``[rows]``.
        Returns int64 ``[rows]``, -1 where the row has no distribution (a NaN or +inf in it, or nothing above
        -inf), and each row's largest value and logsum as ``log_softmax_stats`` gives them, from the same pass
        at temperature 1 (NaN both for a truncating row the kernel had no memory for)."""
        return self._draw(x, scale, top_k, top_p, min_p, u)

    def top_values(self, x: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest values of the rows ``rows`` (int64 ``[n]``) of float32 ``x`` ``[.., vocab]`` (rows
        contiguous) and their indices, ``[n, k]`` each, largest first, as ``x[rows].topk(k)`` gives them (of equal
        values the lower index first), without copying the rows out."""
        return self._top_values(x, rows, k)

    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x W^T`` for one bfloat16 row ``x`` ``[1, K]``, ``W`` = int8 ``qweight`` ``[N, K]`` times bfloat16
        ``scales`` ``[N]`` per row, as ``aten._weight_int8pack_mm`` computes it. Returns ``[1, N]`` bfloat16."""
        return self._int8_linear(x, qweight, scales)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` for rows ``x`` ``[M, K]`` (one, or a few: it reads ``weight`` once for all, and sums
        each row exactly as it sums that row alone), ``weight`` ``[N, K]`` and ``bias`` ``[N]``, all bfloat16
        or all float32, summed in float32 (and rounded once to bfloat16), as oneDNN's linear does. Returns
        ``[M, N]``."""
        return self._gemv(x, weight, bias)

    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A copy of a bfloat16 ``weight`` ``[N, K]`` with its elements in ``gemm_pairs``'s layout (the same
        shape, so only these kernels can read it), or None where that kernel does not run: no AVX512-BF16, or
        N not a multiple of 32, or K odd."""
        return self._pack_pairs(weight)

    def gemm_pairs(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        amx: bool = False,
    ) -> torch.Tensor:
        """``x W^T + b`` for a few bfloat16 rows ``x`` ``[M, K]``, with W ``[out_features, K]`` as
        ``pack_pairs`` made it and ``bias`` ``[out_features]`` bfloat16; float32 sums rounded once. ``[M, N]``.
        ``amx``: on the AMX tile unit (where ``pairs_amx(K)``), whose sums go in another order."""
        return self._gemm_pairs(x, pairs, out_features, bias, amx)

    def pairs_amx(self, in_features: int) -> bool:
        """Whether ``gemm_pairs`` can run ``amx=True`` for ``in_features``: an AMX CPU that Linux lets use
        its tiles, and ``in_features`` a multiple of 32."""
        return self._pairs_amx(in_features)

    def w8a8_pack(self, qweight: torch.Tensor) -> torch.Tensor | None:
        """An int8 ``qweight`` ``[N, K]`` in ``w8a8_linear``'s layout (an opaque 1-D int8 tensor: 16 outputs x 4
        of K per vector, then each output's zero-point compensation, then N and K), or None where that kernel
        does not run (no AVX512-VNNI)."""
        return self._w8a8_pack(qweight)

    def w8a8_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        silu_mul: bool = False,
        float_out: bool = False,
    ) -> torch.Tensor:
        """``x W^T + b`` in int8 for ``x`` ``[M, K]`` bfloat16 or float32: each row of ``x`` quantized to int8
        with its own scale (max |x| / 127, rounded to nearest), multiplied by W = ``packed`` (``w8a8_pack``'s)
        times float32 ``scales`` ``[out_features]`` per output with int32 sums, scaled back and ``bias`` (x's
        dtype, ``[out_features]``) added in float32, rounded once to x's dtype. Returns ``[M, out_features]``.

        ``silu_mul``: W's rows come in pairs of 16-row blocks, a gate block then its up block (out_features
        a multiple of 32), and the result is ``[M, out_features / 2]``: ``silu_mul`` of the product, pair by
        pair (to the last bit in bfloat16 on AVX512-BF16 CPUs, whose SiLU both share), without the product's
        own ``[M, out_features]`` in memory.

        ``float_out``: the result in float32 whatever x's dtype, holding the same values (rounded to x's
        dtype), without a separate conversion pass: an LM head's logits."""
        return self._w8a8_linear(x, packed, scales, out_features, bias, silu_mul, float_out)

    def w8a8_use_amx(self, enable: bool | None = None) -> bool:
        """Whether ``w8a8_linear`` runs 8 rows or more on AMX-INT8 tiles (CPUs that have them, where Linux grants
        them), not AVX512-VNNI; ``enable`` turns that on or off for the whole process first. Both give the same int32
        sums, so the same output to the last bit: the switch is for comparing the two."""
        return self._w8a8_use_amx(enable)

    def attention_use_amx(self, enable: bool | None = None) -> bool:
        """Whether bfloat16 ``decode_attention`` and ``prefill_attention`` take their scores (q . k) on AMX tiles
        (CPUs that have them, where Linux grants them; for decoding, 16-token cache blocks or multiples) rather
        than AVX512-BF16; ``enable`` turns that on or off for the whole process first. Both sum exact bfloat16
        products in float32, in different orders: the switch is for comparing the two."""
        return self._attention_use_amx(enable)

    def decoding_step(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        cos_sin: torch.Tensor,
        *,
        heads: int,
        intermediate: int,
        eps: float,
        scale: float,
    ) -> DecodingStep:
        """A one-call decoding step over these bfloat16 weights and caches (models/decoding_step.py builds
        it); ValueError for any it cannot read.

        Every tensor must be contiguous on the CPU, the norms and biases
        bfloat16 (the weights and scales as ``LinearWeights`` says), the caches
        bfloat16 or int8 (``decodes_int8_cache``), ``cos_sin`` float32
        ``[positions, head_dim]``; ``intermediate`` is the MLP's inner size.
        """
        tensors: list[torch.Tensor | None] = []
        layouts = []
        for layer in layers:
            tensors += [layer.input_norm, layer.post_norm, layer.kv_cache]
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                tensors += [linear.weight, linear.scales, linear.bias]
                kind = LINEAR_KINDS.index(linear.kind)
                layouts += [kind, linear.vector_rows, linear.max_rows, int(linear.silu_mul)]
        native = torch.classes.servelm.Decoder(tensors, layouts, final_norm, cos_sin, heads, intermediate, eps, scale)
        return DecodingStep(native)
