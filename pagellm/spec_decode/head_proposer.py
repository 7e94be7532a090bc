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
from functools import partial
from typing import Any

import numpy as np
import torch

from pagellm.core.native_decode import HeadRows, NativeHeadStep
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
        # the platform's pass of the head (`Platform.native_head_step`), where it has one; set by the runner
        self.native: NativeHeadStep | None = None

    def observe(self, step: StepInputs) -> None:
        if step.rows is None:
            raise RuntimeError(f"{self.name} needs each step's batch rows (StepInputs.rows)")
        self._run_pending((), [])  # a step before that no request drafted after: its prompt chunks' rows
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
        first = self._run_pending(requests, live)
        if first is None:
            return drafts
        tokens, hidden = first
        rows = np.array([requests[i].row for i in live], dtype=np.int64)
        positions = np.array([len(requests[i].token_ids) - 1 for i in live], dtype=np.int64)
        step = 0
        while True:  # tokens, hidden: each live request's next draft and the head's output it came from
            ids = np.array(tokens.tolist(), dtype=np.int64)
            for j, token in enumerate(ids.tolist()):
                drafts[live[j]].append(token)
            step += 1
            keep = [j for j, i in enumerate(live) if requests[i].num_drafts > step]
            if not keep:
                return drafts
            if len(keep) < len(live):
                hidden = hidden[to_device(np.array(keep, dtype=np.int64), self.device)]
                ids, rows, positions, live = ids[keep], rows[keep], positions[keep], [live[j] for j in keep]
            tokens, hidden = self._pass(
                ids,
                positions,
                self.batch.block_table[rows],
                hidden,
                np.arange(len(live), dtype=np.int64),
                partial(
                    one_token_batch, self.batch.block_table, rows, positions, self.block_size, self.device
                ),
            )
            positions = positions + 1

    def _run_pending(
        self, requests: Sequence[DraftRequest], live: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head over the last step's rows whose successor is known now: a prompt chunk's all, a drafting
        request's up to the position before its newest token (its successors: the tokens it has now), no
        other request's. Returns the drafts from the rows of each `live` request's newest position - 1 (its
        first draft) and the head's output there, in the order of `live`; None where none drafts."""
        pending, self.pending = self.pending, None
        by_row = {requests[i].row: i for i in live}
        picked, firsts, counts, requests_of_step, last_rows = [], [], [], [], {}
        steps = pending.step.rows.tolist() if pending is not None else []
        successors = pending.successors.copy() if pending is not None else None
        for s, row in enumerate(steps):
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
        missing = [requests[i].request_id for i in live if i not in last_rows]
        if missing:
            raise RuntimeError(f"{self.name}: requests {missing} have no rows in the last step to draft from")
        if not picked:
            return None
        of_step, starts = np.array(requests_of_step, dtype=np.int64), np.array(firsts, dtype=np.int64)
        lengths = np.array(counts, dtype=np.int64)
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(firsts, counts, strict=True)])
        drafts, hidden = self._pass(
            successors[picked],
            positions,
            pending.tables[np.repeat(of_step, lengths)],
            pending.features[to_device(np.array(picked, dtype=np.int64), self.device)],
            np.array([last_rows[i] for i in live], dtype=np.int64),
            partial(chunk_batch, pending.tables, of_step, starts, lengths, self.block_size, self.device),
        )
        return (drafts, hidden) if live else None

    def _pass(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        tables: np.ndarray,
        hidden: torch.Tensor,
        picks: np.ndarray,
        attention: Callable[[], Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the head over rows (`ids` at `positions`, each with its request's block table row and
        the hidden state it reads; a request's rows at consecutive positions, in order): the drafts of the
        rows `picks` and the head's outputs there. The platform's native pass where it takes this many
        rows, else the head's forward over `attention()` (the rows' attention batch)."""
        if self.native is not None and len(ids) <= self.native.max_rows:
            bs = self.block_size
            tables = tables[:, : -(-int(positions.max() + 1) // bs)]
            slots = tables[np.arange(len(ids)), positions // bs].astype(np.int64) * bs + positions % bs
            return self.native(HeadRows(ids, positions, slots, tables, hidden, picks))
        with set_forward_context(self.backend.build_metadata(attention()), self.kv_caches, self.layers):
            normed, out = self.head(to_device(ids, self.device), to_device(positions, self.device), hidden)
        index = to_device(picks, self.device)
        if not len(picks):
            return index, out[index]
        return self.head.greedy_tokens(normed[index]), out[index]


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
