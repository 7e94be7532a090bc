"""The persistent batch: per-request token and block-table rows kept across steps, and the flat step
inputs gathered from them.

A request gets a row when first scheduled and keeps it until it finishes or is preempted; each step only
appends its new tokens and new blocks, so building the step's flat inputs (`InputBatch.step_arrays`) is a
few numpy gathers. `PreparedStep` is what `ModelRunner._prepare_inputs` makes of a step: those inputs and
which rows each request's outputs come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch
from pagellm.core.transfer import to_device
from pagellm.models.context import ImageBatch, LoRABatch
from pagellm.worker.step import ScheduledRequest, StepArrays


@dataclass
class PreparedStep:
    """One step, ready for the forward: the model's inputs and, by the request's index i in the batch, where
    its rows are (`cu[i]:cu[i + 1]`, from position `starts[i]`) and what it wants of them."""

    arrays: StepArrays  # what every rank's forward reads
    cu: np.ndarray  # [B + 1] int64: query start of each request in the flat batch
    starts: list[int]  # position of each request's first scheduled token
    sampling: list[tuple[int, ScheduledRequest]]  # (index, request): reaches its last token, samples
    prompt_logprobs: list[tuple[int, ScheduledRequest]]  # (index, request): logprobs of prompt tokens
    pooling: list[tuple[int, ScheduledRequest]]  # (index, request): pooled, never sampled
    lora: LoRABatch | None = None  # the step's adapter rows and slots on the device (driver only)
    images: ImageBatch | None = None  # the step's image placeholder rows and their embeddings


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_groups: int = 1):
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # one block table per KV cache group; `block_table` is group 0's (a draft model reads it)
        self.block_tables = [
            np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32) for _ in range(num_kv_groups)
        ]
        self.block_table = self.block_tables[0]
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        # leading blocks of each group's row known to be freed (a sliding window's null block, id 0)
        self.num_freed = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def row(self, request_id: str) -> int:
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self.free_rows.pop()
            self.num_tokens[row] = 0
            self.num_blocks[:, row] = 0
            self.num_freed[:, row] = 0
        return row

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def sync(self, row: int, token_ids: list[int], block_ids: Sequence[list[int]]) -> None:
        """Append the tokens and blocks that are new since the last sync of this row (`block_ids`: one list
        per KV cache group), and zero the blocks a sliding window freed since (they lead the list)."""
        have = int(self.num_tokens[row])
        if len(token_ids) > have:
            self.token_ids[row, have : len(token_ids)] = token_ids[have:]
            self.num_tokens[row] = len(token_ids)
        for g, ids in enumerate(block_ids):
            if len(ids) != self.num_blocks[g, row]:
                self.block_tables[g][row, : len(ids)] = ids
                self.num_blocks[g, row] = len(ids)
            freed = start = int(self.num_freed[g, row])
            while freed < len(ids) and ids[freed] == 0:
                freed += 1
            if freed != start:
                self.block_tables[g][row, start:freed] = 0
                self.num_freed[g, row] = freed

    def step_arrays(
        self, rows: list[int], starts: list[int], counts: list[int]
    ) -> tuple[StepArrays, np.ndarray]:
        """The flat inputs of a step in which the request in row `rows[i]` runs `counts[i]` tokens from
        position `starts[i]`, and the query start of each request (cu, int64)."""
        counts_np = np.asarray(counts, dtype=np.int64)
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts_np, out=cu[1:])
        num_tokens = int(cu[-1])
        token_rows = np.repeat(np.asarray(rows, dtype=np.int64), counts_np)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - np.asarray(starts), counts_np)
        bs = self.block_size
        seq_lens = np.asarray(starts, dtype=np.int64) + counts_np
        width, blocks, offsets = int(-(-seq_lens.max() // bs)), positions // bs, positions % bs
        groups = [
            (table[rows, :width], table[token_rows, blocks].astype(np.int64) * bs + offsets)
            for table in self.block_tables
        ]
        arrays = StepArrays(
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=groups[0][0],
            slot_mapping=groups[0][1],
            more_groups=tuple(groups[1:]),
            batch_rows=np.asarray(rows, dtype=np.int64),
        )
        return arrays, cu


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, through page-locked memory where the device has it (so the host does not
    wait, and the array may change right after); on the CPU the array's own memory."""
    return to_device(torch.from_numpy(np.ascontiguousarray(array)), device)


def attention_batches(step: StepArrays, device: torch.device) -> list[AttentionBatch]:
    """The step's attention batch of each KV cache group on the device, group 0 first: one set of query
    offsets and lengths, each group's own block tables and slot mapping."""
    query_start_loc = host_to_device(step.query_start_loc, device)
    seq_lens = host_to_device(step.seq_lens, device)
    max_query_len, max_seq_len = int(np.diff(step.query_start_loc).max()), int(step.seq_lens.max())
    spans = () if step.bidirectional is None else tuple(map(tuple, step.bidirectional.tolist()))
    return [
        AttentionBatch(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=host_to_device(block_tables, device),
            slot_mapping=host_to_device(slot_mapping, device),
            query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
            seq_lens_cpu=torch.from_numpy(step.seq_lens),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            bidirectional=spans,
        )
        for block_tables, slot_mapping in step.kv_groups()
    ]


def mrope_positions(
    scheduled: Sequence[ScheduledRequest], positions: np.ndarray, cu: np.ndarray
) -> np.ndarray:
    """[3, T] positions of a step for a multimodal rope: a prompt token's from its request's
    `mrope_positions` ([3, P]), any later token's p + `mrope_delta` on all three axes (a request without
    them, text only, has its plain positions on all three)."""
    out = np.repeat(positions[None, :], 3, axis=0)
    for i, request in enumerate(scheduled):
        table = getattr(request, "mrope_positions", None)
        if table is None:
            continue
        block = out[:, int(cu[i]) : int(cu[i + 1])]  # a view: written in place
        p = positions[int(cu[i]) : int(cu[i + 1])]
        in_prompt = p < table.shape[1]
        block[:] = p + request.mrope_delta
        block[:, in_prompt] = table[:, p[in_prompt]]
    return out


def image_spans(
    scheduled: Sequence[ScheduledRequest], starts: Sequence[int], counts: Sequence[int]
) -> np.ndarray:
    """[S, 3] int64: (request index, first position, end position) of each image whose tokens the step's
    chunk of that request overlaps, for a model whose image tokens attend to each other both ways (the
    scheduler gives such an image's uncached tokens to one chunk)."""
    spans = [
        (i, image.offset, image.end)
        for i, request in enumerate(scheduled)
        for image in getattr(request, "images", ())
        if image.offset < starts[i] + counts[i] and image.end > starts[i]
    ]
    return np.asarray(spans, dtype=np.int64).reshape(-1, 3)
