"""A proposer for draft heads that read the target's hidden states (EAGLE-3, multi-token prediction):
the head drafts k tokens in a chain, each step feeding its own output back.

The head's KV at position i comes from the token at i + 1 and the target's hidden states at i. Like a
draft model's, its KV has its own tensors addressed by the target's block tables, so prefix-cache blocks,
chunks and preemption need nothing of their own. `observe` runs the head over each step's tokens with
each token's successor: the next token of the step, or for the step's last token of a request the next
prompt token when the prompt goes on (a chunk); where the successor is still to be sampled the row gets a
placeholder, rewritten by `propose` before anything reads it. `propose` starts at the position before the
request's newest token (the row whose successor is now known: the target's own token after the accepted
drafts, replacing a rejected draft's row) with the target's hidden states there, and each further step
feeds the head's own output back (positions past the target's, in the lookahead slots the scheduler
allocated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pagellm.models.context import set_forward_context
from pagellm.spec_decode.draft_model import one_token_batch, to_device
from pagellm.spec_decode.proposer import DraftRequest, Proposer, StepInputs


class ChainedHeadProposer(Proposer):
    def __init__(
        self,
        name: str,
        head: Any,
        features: Callable[[StepInputs], torch.Tensor],
        kv_caches: list[torch.Tensor],
        backend: Any,
        block_size: int,
        batch: Any,
        device: torch.device,
    ):
        """`head`: (input ids, positions, hidden) -> (normed output, output before the norm), with
        `greedy_tokens(normed)` and `attention_layers()` (by layer_idx); `features`: the hidden states it
        reads of a step's target forward, one row a token; `batch`: the runner's persistent batch
        (`InputBatch`: token ids, known token counts and block tables per row, kept current by the runner)."""
        self.name = name
        self.head = head
        self.features_of = features
        self.kv_caches = kv_caches
        self.layers = head.attention_layers()
        self.backend = backend
        self.block_size = block_size
        self.batch = batch
        self.device = device
        self.features: torch.Tensor | None = None  # the last step's fc(auxiliary hidden states), [T, H]
        self.segments: dict[
            int, tuple[int, int, int]
        ] = {}  # batch row -> (first feature row, position, count)

    def observe(self, step: StepInputs) -> None:
        if step.rows is None:
            raise RuntimeError(f"{self.name} needs each step's batch rows (StepInputs.rows)")
        features = self.features_of(step)
        cu = step.attn.query_start_loc_cpu.numpy().astype(np.int64)
        counts = cu[1:] - cu[:-1]
        starts = step.attn.seq_lens_cpu.numpy().astype(np.int64) - counts
        successors = torch.empty_like(step.input_ids)
        successors[:-1] = step.input_ids[1:]
        ends = starts + counts  # the position after each request's last token of the step
        known = ends < self.batch.num_tokens[step.rows]  # a prompt that goes on; else still to be sampled
        last = np.where(known, self.batch.token_ids[step.rows, np.where(known, ends, 0)], 0)
        successors[to_device(cu[1:] - 1, self.device)] = to_device(last, self.device)
        with set_forward_context(self.backend.build_metadata(step.attn), self.kv_caches, self.layers):
            self.head(successors, step.positions, features)
        self.features = features
        self.segments = {
            int(row): (int(cu[s]), int(starts[s]), int(counts[s])) for s, row in enumerate(step.rows)
        }

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        if not live:
            return drafts
        rows = np.array([requests[i].row for i in live], dtype=np.int64)
        positions = np.array([len(requests[i].token_ids) - 2 for i in live], dtype=np.int64)
        hidden = self.features[to_device(self._feature_rows(rows, positions), self.device)]
        tokens = to_device(np.array([requests[i].token_ids[-1] for i in live], dtype=np.int64), self.device)
        step = 0
        while True:
            attn = one_token_batch(self.batch.block_table, rows, positions, self.block_size, self.device)
            with set_forward_context(self.backend.build_metadata(attn), self.kv_caches, self.layers):
                normed, hidden = self.head(tokens, to_device(positions, self.device), hidden)
            tokens = self.head.greedy_tokens(normed)
            for j, token in enumerate(tokens.tolist()):
                drafts[live[j]].append(token)
            step += 1
            keep = [j for j, i in enumerate(live) if requests[i].num_drafts > step]
            if not keep:
                return drafts
            if len(keep) < len(live):
                index = to_device(np.array(keep, dtype=np.int64), self.device)
                tokens, hidden = tokens[index], hidden[index]
                rows, positions, live = rows[keep], positions[keep], [live[j] for j in keep]
            positions = positions + 1

    def _feature_rows(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Where the last step's features hold each request's target hidden states at `positions`."""
        out = np.empty(len(rows), dtype=np.int64)
        for j, (row, position) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
            first, start, count = self.segments[row]
            if not 0 <= position - start < count:
                raise RuntimeError(
                    f"{self.name}: position {position} of batch row {row} did not run last step"
                )
            out[j] = first + position - start
        return out
