"""A proposer for draft heads that read the target's KV cache instead of keeping their own (Gemma 4's
assistants, `gemma4_assistant.py`).

Such a head drafts from the newest token's position p with attention over the target's cached KV before
p, so all it needs of a step is the target's final hidden state at p - 1: `observe` keeps the step's
hidden states and where each request's rows start, and `propose` picks that row for every drafting
request (the step computed it: the last prompt row, the last accepted draft's or the verified token's).
Each draft step is then one row a request at position p, reading the target's caches through each
group's block table, with negative slots so nothing is stored. Prefix-cache hits, chunked prefill,
preemption and rejected drafts leave nothing of the head's to fix: it holds no state across steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch
from pagellm.models.context import set_forward_context
from pagellm.spec_decode.draft_model import to_device
from pagellm.spec_decode.proposer import DraftRequest, Proposer, StepInputs


class SharedKVHeadProposer(Proposer):
    def __init__(
        self,
        name: str,
        head: Any,
        embed: Callable[[torch.Tensor], torch.Tensor],
        kv_caches: list[torch.Tensor],
        group_of: Callable[[int], int],
        backend: Any,
        block_size: int,
        batch: Any,
        device: torch.device,
    ):
        """`head`: (embeddings, hidden, positions) -> (normed, next hidden), with `greedy_tokens(normed)`,
        `sources` (per head layer, the target layer whose KV it reads) and `reading_layers()`; `embed`: the
        target's input embedding; `kv_caches`: the target's, by layer; `group_of`: a target layer's KV cache
        group; `batch`: the runner's persistent batch (`InputBatch`: block tables per group and row)."""
        self.name = name
        self.head = head
        self.embed = embed
        self.kv_caches = [kv_caches[s] for s in head.sources]  # by head layer
        self.groups = [group_of(s) for s in head.sources]
        self.layers = head.reading_layers()
        self.backend = backend
        self.block_size = block_size
        self.batch = batch
        self.device = device
        self.last: StepInputs | None = None

    def observe(self, step: StepInputs) -> None:
        if step.rows is None:
            raise RuntimeError(f"{self.name} needs each step's batch rows (StepInputs.rows)")
        self.last = step

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        if not live:
            return drafts
        rows = np.array([requests[i].row for i in live], dtype=np.int64)
        positions = np.array([len(requests[i].token_ids) - 1 for i in live], dtype=np.int64)
        hidden = self.last.hidden[to_device(self._rows_before(rows, positions), self.device)]
        tokens = to_device(np.array([requests[i].token_ids[-1] for i in live], dtype=np.int64), self.device)
        where = to_device(positions, self.device)
        metadata = {g: self.backend.build_metadata(self._batch(g, rows, positions)) for g in set(self.groups)}
        per_layer = [metadata[g] for g in self.groups]
        steps = max(requests[i].num_drafts for i in live)
        made = []
        with set_forward_context(per_layer[0], self.kv_caches, self.layers, layer_metadata=per_layer):
            for _ in range(steps):
                normed, hidden = self.head(self.embed(tokens), hidden, where)
                tokens = self.head.greedy_tokens(normed)
                made.append(tokens)
        for j, i in enumerate(torch.stack(made, dim=1).tolist()):
            drafts[live[j]] = i[: requests[live[j]].num_drafts]
        return drafts

    def _rows_before(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Each request's row of the last step's hidden states at the position before its newest token."""
        step = self.last
        cu = step.attn.query_start_loc_cpu.numpy().astype(np.int64)
        ends = step.attn.seq_lens_cpu.numpy().astype(np.int64)
        where = {int(row): s for s, row in enumerate(step.rows.tolist())}
        index = np.empty(len(rows), dtype=np.int64)
        for j, (row, p) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
            s = where.get(row)
            count = int(cu[s + 1] - cu[s]) if s is not None else 0
            start = int(ends[s]) - count if s is not None else 0
            if s is None or not start <= p - 1 < start + count:
                raise RuntimeError(
                    f"{self.name}: row {row} has no hidden state at position {p - 1} in the last step"
                )
            index[j] = cu[s] + p - 1 - start
        return index

    def _batch(self, group: int, rows: np.ndarray, positions: np.ndarray) -> AttentionBatch:
        """One query a request over the target's KV before its position p, in KV cache group `group`: to the
        backend a decode at p - 1 (whose window then ends at p - 1) that stores nothing (slot -1)."""
        seq_lens = positions.astype(np.int32)
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        tables = self.batch.block_tables[group][rows, :max_blocks]
        query_start = np.arange(len(rows) + 1, dtype=np.int32)
        return AttentionBatch(
            query_start_loc=to_device(query_start, self.device),
            seq_lens=to_device(seq_lens, self.device),
            block_tables=to_device(tables, self.device),
            slot_mapping=to_device(np.full(len(rows), -1, dtype=np.int64), self.device),
            query_start_loc_cpu=torch.from_numpy(query_start),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
        )
