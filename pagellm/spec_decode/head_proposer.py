"""A proposer for draft heads that read the target's hidden states (EAGLE-3, multi-token prediction):
the head drafts k tokens in a chain, each step feeding its own output back.

The head's KV at position i comes from the token at i + 1 and the target's hidden states at i. Like a
draft model's, its KV has its own tensors addressed by the target's block tables, so prefix-cache blocks,
chunks and preemption need nothing of their own. `observe` keeps each step's features (what the head reads
of the target's states); the head runs over the step's rows at the next `propose`, when every row's
successor is known: the step's next token, the next prompt token after a chunk, or for a request that got
tokens the accepted drafts and the target's own token. Its rows then go up to the position before the
request's newest token (rejected drafts' rows are left out: their positions are written again when they
come back), and the output at that last row is the first draft; each further step feeds the head's own
output back (positions past the target's, in the lookahead slots the scheduler allocated). A request that
got tokens but drafts nothing more (its last token is next) needs no rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagellm.models.context import set_forward_context
from pagellm.spec_decode.draft_model import chunk_batch, one_token_batch, to_device
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
        self.pending: _Pending | None = None  # the last step's rows, the head not yet run over them

    def observe(self, step: StepInputs) -> None:
        if step.rows is None:
            raise RuntimeError(f"{self.name} needs each step's batch rows (StepInputs.rows)")
        self._run_pending(())  # a step before that no request drafted after: its prompt chunks' rows
        cu = step.attn.query_start_loc_cpu.numpy().astype(np.int64)
        counts = cu[1:] - cu[:-1]
        starts = step.attn.seq_lens_cpu.numpy().astype(np.int64) - counts
        successors = np.empty(len(step.positions), dtype=np.int64)
        successors[:-1] = step.input_ids[1:].cpu().numpy()
        ends = starts + counts  # the position after each request's last token of the step
        known = ends < self.batch.num_tokens[step.rows]  # a prompt that goes on; else still to be sampled
        last = self.batch.token_ids[step.rows, np.where(known, ends, 0)]
        successors[cu[1:] - 1] = np.where(known, last, -1)
        tables = self.batch.block_table[step.rows].copy()  # the rows may change hands before the head runs
        self.pending = _Pending(step, self.features_of(step), successors, cu, starts, counts, tables)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        outputs = self._run_pending(requests)
        last_rows = outputs[2] if outputs is not None else {}
        missing = [requests[i].request_id for i in live if i not in last_rows]
        if missing:
            raise RuntimeError(f"{self.name}: requests {missing} have no rows in the last step to draft from")
        if not live:
            return drafts
        normed, hidden = outputs[0], outputs[1]
        index = to_device(np.array([last_rows[i] for i in live], dtype=np.int64), self.device)
        normed, hidden = normed[index], hidden[index]
        rows = np.array([requests[i].row for i in live], dtype=np.int64)
        positions = np.array([len(requests[i].token_ids) - 1 for i in live], dtype=np.int64)
        step = 0
        while True:  # normed, hidden: the head's output at each live request's newest position - 1
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
            attn = one_token_batch(self.batch.block_table, rows, positions, self.block_size, self.device)
            with set_forward_context(self.backend.build_metadata(attn), self.kv_caches, self.layers):
                normed, hidden = self.head(tokens, to_device(positions, self.device), hidden)
            positions = positions + 1

    def _run_pending(
        self, requests: Sequence[DraftRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None:
        """The head over the last step's rows whose successor is known now: a prompt chunk's all, a drafting
        request's up to the position before its newest token (its successors: the tokens it has now), no
        other request's. Returns the head's (normed, hidden) of those rows and, for each drafting request
        (by index in `requests`), the row of its newest position - 1; None where nothing ran."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        by_row = {r.row: i for i, r in enumerate(requests) if r.num_drafts > 0}
        picked, firsts, counts, requests_of_step, last_rows = [], [], [], [], {}
        successors = pending.successors.copy()
        for s, row in enumerate(pending.step.rows.tolist()):
            first, start, count = int(pending.cu[s]), int(pending.starts[s]), int(pending.counts[s])
            if successors[first + count - 1] < 0:  # the step sampled this request's next token
                if row not in by_row:
                    continue  # nothing more to draft for it
                i = by_row[row]
                tokens = requests[i].token_ids
                count = len(tokens) - 1 - start  # up to the position before its newest token
                successors[first : first + count] = tokens[start + 1 : start + 1 + count]
                last_rows[i] = len(picked) + count - 1
            picked.extend(range(first, first + count))
            firsts.append(start)
            counts.append(count)
            requests_of_step.append(s)
        if not picked:
            return None
        index = to_device(np.array(picked, dtype=np.int64), self.device)
        attn = chunk_batch(
            pending.tables,
            np.array(requests_of_step, dtype=np.int64),
            np.array(firsts, dtype=np.int64),
            np.array(counts, dtype=np.int64),
            self.block_size,
            self.device,
        )
        ids = to_device(successors[picked], self.device)
        with set_forward_context(self.backend.build_metadata(attn), self.kv_caches, self.layers):
            normed, hidden = self.head(ids, pending.step.positions[index], pending.features[index])
        return normed, hidden, last_rows


@dataclass
class _Pending:
    """A target step's rows the head is still to run over: the step, what the head reads of each row
    (`features`), each row's successor (-1: the token the step samples), its requests' query starts,
    first positions and token counts, and their block tables as they were."""

    step: StepInputs
    features: torch.Tensor
    successors: np.ndarray
    cu: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    tables: np.ndarray
