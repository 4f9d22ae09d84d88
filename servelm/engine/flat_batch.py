"""One step's sequences laid out as the flattened batch a model call takes.

Each chunk is new tokens of a sequence at consecutive positions (a prompt
chunk, a decode's one token; a speculating decode gives one chunk per token
it verifies); the chunks are concatenated without padding, and the slot
mapping and block tables tell the attention layers where each token's K/V
go in the paged cache. The target model's runner and the draft model build
their batches here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.layers.attention import AttentionMetadata


@dataclass
class Chunk:
    """``token_ids`` computed at positions ``start``, ``start + 1``, ... of a sequence whose K/V blocks are
    ``block_table``."""

    token_ids: list[int]
    start: int
    block_table: list[int]


@dataclass
class FlatBatch:
    """The model call's inputs, and the flattened row of each chunk's last token."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_rows: list[int]


def flatten(chunks: list[Chunk], num_prefills: int, block_size: int, device: torch.device) -> FlatBatch:
    """Lay ``chunks`` out in order; the first ``num_prefills`` go through prefill attention, and each of the
    others must hold exactly one token (decode attention)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    last_rows: list[int] = []
    bs = block_size
    for chunk in chunks:
        start, table = chunk.start, chunk.block_table
        end = start + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_lens.append(end - start)
        context_lens.append(end)
        tables.append(table)
        last_rows.append(len(input_ids) - 1)

    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    decode_lens = context_lens[num_prefills:]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables.to(device),
        num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]),
        decode_lens=torch.tensor(decode_lens, dtype=torch.long, device=device) if decode_lens else None,
    )
    return FlatBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        last_rows=last_rows,
    )
