"""A draft model: a smaller model with the target's vocabulary proposes greedily.

Its KV cache has its own tensors but the target's blocks: the same block tables and slots address both.
After every target forward the draft runs the same tokens (`observe`), so whatever KV the target holds,
the draft holds too, at the same positions: prefix-cache hits, chunked prefill, preemption and rejected
drafts (recomputed later by both) need nothing of their own. Proposing then takes k one-token steps per
request from its newest token, writing draft KV into the lookahead slots the scheduler allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch
from pagellm.models.context import set_forward_context
from pagellm.sampling.sampler import argmax
from pagellm.spec_decode.proposer import DraftRequest, Proposer, StepInputs


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        backend: Any,
        block_size: int,
        block_table: np.ndarray,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.layers = model.attention_layers()
        self.backend = backend
        self.block_size = block_size
        self.block_table = block_table  # the runner's persistent batch: rows of block ids, kept current
        self.device = device

    def observe(self, step: StepInputs) -> None:
        with set_forward_context(self.backend.build_metadata(step.attn), self.kv_caches, self.layers):
            self.model(step.input_ids, step.positions)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        tokens = np.array([r.token_ids[-1] if r.token_ids else 0 for r in requests], dtype=np.int64)
        positions = np.array([len(r.token_ids) - 1 for r in requests], dtype=np.int64)
        rows = np.array([r.row for r in requests], dtype=np.int64)
        step = 0
        while live:
            index = np.asarray(live)
            new = self._step(tokens[index], positions[index], rows[index])
            for j, i in enumerate(live):
                drafts[i].append(new[j])
                tokens[i], positions[i] = new[j], positions[i] + 1
            step += 1
            live = [i for i in live if requests[i].num_drafts > step]
        return drafts

    def _step(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> list[int]:
        """One token per request at `positions`: its KV stored, its argmax next token returned."""
        attn = one_token_batch(self.block_table, rows, positions, self.block_size, self.device)
        with set_forward_context(self.backend.build_metadata(attn), self.kv_caches, self.layers):
            hidden = self.model(to_device(tokens, self.device), to_device(positions, self.device))
        return argmax(self.model.compute_logits(hidden)).tolist()


def one_token_batch(
    block_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int, device: torch.device
) -> AttentionBatch:
    """The attention batch of one query token per request (the request in persistent-batch row `rows[i]`
    at `positions[i]`), its KV stored at that position's slot of the target's block table: a proposer
    with a KV cache of its own steps this way, one draft token at a time."""
    return chunk_batch(
        block_table, rows, positions, np.ones(len(positions), dtype=np.int64), block_size, device
    )


def chunk_batch(
    block_table: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionBatch:
    """The attention batch of `counts[i]` query tokens of the request in persistent-batch row `rows[i]`, at
    positions `starts[i]` onwards (the end of its context), their KV stored at those positions' slots of
    the target's block table."""
    bs = block_size
    seq_lens = (starts + counts).astype(np.int32)
    max_blocks = int(-(-seq_lens.max() // bs))
    positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)])
    slots = block_table[np.repeat(rows, counts), positions // bs].astype(np.int64) * bs + positions % bs
    query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return AttentionBatch(
        query_start_loc=to_device(query_start, device),
        seq_lens=to_device(seq_lens, device),
        block_tables=to_device(block_table[rows, :max_blocks], device),
        slot_mapping=to_device(slots, device),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens_cpu=torch.from_numpy(seq_lens),
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
    )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
