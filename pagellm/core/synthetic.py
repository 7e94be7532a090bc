"""Synthetic paged steps, on which the selector's timer runs backends and `pagellm.testing` checks them.

Here, in the runtime's core next to the selector, so that `pagellm.testing` (shipped for plugin authors)
imports it and the runtime never imports test helpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagellm.core.attention import AttentionBatch

SPARE_BLOCKS = 4
"""Blocks no request owns, so a backend that reads outside its block table reads the wrong data."""


def blocks_needed(seq_lens: Sequence[int], block_size: int) -> int:
    """Blocks the requests own together, plus `SPARE_BLOCKS`: the default `num_blocks`."""
    return sum(math.ceil(n / block_size) for n in seq_lens) + SPARE_BLOCKS


def make_paged_batch(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    num_blocks: int | None = None,
    device: torch.device | str = "cpu",
    block_tables: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AttentionBatch:
    """A step in which request i has seq_lens[i] tokens of context, the last query_lens[i] of them new.

    Each request gets randomly drawn, shuffled blocks out of `num_blocks` (default `blocks_needed`), so
    block ids are neither contiguous nor ordered; unused table entries are 0. Pass `block_tables` to keep
    an earlier step's assignment (a later chunk of the same requests)."""
    assert all(0 < q <= s for q, s in zip(query_lens, seq_lens, strict=True)), "need 0 < query_len <= seq_len"
    per_req = [math.ceil(n / block_size) for n in seq_lens]
    if block_tables is None:
        num_blocks = num_blocks or blocks_needed(seq_lens, block_size)
        ids = torch.randperm(num_blocks, generator=generator).tolist()
        block_tables = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
        for i, n in enumerate(per_req):
            block_tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            ids = ids[n:]
    block_tables = block_tables.to("cpu", torch.int32)
    slots = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(seq_len - query_len, seq_len)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_t = torch.tensor(list(seq_lens), dtype=torch.int32)
    return AttentionBatch(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
