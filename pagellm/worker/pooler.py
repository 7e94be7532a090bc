"""Pooling a prompt's final hidden states into one vector per request (`runner="pooling"`), across the
steps its prompt runs in (chunked prefill).

Per request: MEAN keeps the float32 sum of each chunk's rows by the chunk's start position (a step rerun
after a failure overwrites its own chunk rather than adding it twice), CLS the first position's state, LAST
reads the final chunk's last row (a classify request then runs it through the classification head). A LAST request may start past a prefix-cache hit; MEAN and CLS requests
never get one (`Request.needs_every_prompt_position`). Truncation (`dimensions`) and normalisation are the
engine's, on the vector this returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.core.pooling import Classifier
from pagellm.worker.input_batch import PreparedStep
from pagellm.worker.step import StepResult


class PoolingState:
    """What one request's earlier chunks left for its pooled vector."""

    def __init__(self) -> None:
        self.chunk_sums: dict[int, tuple[torch.Tensor, int]] = {}  # MEAN: chunk start -> (row sum, rows)
        self.first: torch.Tensor | None = None  # CLS: the state at position 0

    def add(self, pooling_type: str, rows: torch.Tensor, start: int, num_tokens: int) -> torch.Tensor | None:
        """Take the hidden states of positions start .. start + len(rows) - 1; return the pooled float32
        vector once they reach the prompt's end (`num_tokens`), else None."""
        if pooling_type == "MEAN":
            self.chunk_sums[start] = rows.float().sum(dim=0), rows.shape[0]
        elif pooling_type == "CLS" and start == 0:
            self.first = rows[0].float()
        if start + rows.shape[0] < num_tokens:
            return None
        if pooling_type == "LAST":
            return rows[-1].float()
        if pooling_type == "CLS":
            if self.first is None:
                raise RuntimeError("CLS pooling never saw the prompt's first position")
            return self.first
        if sum(n for _, n in self.chunk_sums.values()) != num_tokens:
            raise RuntimeError("MEAN pooling did not see every position of the prompt")
        return torch.stack([total for total, _ in self.chunk_sums.values()]).sum(dim=0) / num_tokens


def pool_step(
    states: dict[str, PoolingState],
    hidden: torch.Tensor,
    step: PreparedStep,
    result: StepResult,
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Feed each pooling request's rows to its `PoolingState` (`states`: the runner's, by request id, of
    the requests mid-prompt); a prompt that ends in this step gets its pooled float32 vector (on the CPU)
    in `result.pooled`, and its state goes. A classify request gets its classification head's logits
    instead (`compute_logits`: the model's, its score head or its vocabulary)."""
    cu, starts = step.cu, step.starts
    for i, request in step.pooling:
        rid = request.request_id
        params = request.pooling_params
        state = states.setdefault(rid, PoolingState())
        rows = hidden[int(cu[i]) : int(cu[i + 1])]
        vector = state.add(params.pooling_type, rows, starts[i], request.num_tokens)
        if vector is not None:
            if params.classifier is not None and compute_logits is not None:
                vector = class_logits(compute_logits, vector.to(hidden.dtype), params.classifier)
            result.pooled[rid] = vector.cpu()
            del states[rid]


def class_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], vector: torch.Tensor, classifier: Classifier
) -> torch.Tensor:
    """The head's float32 logits for one last-token hidden state: the score layer's, or the vocabulary's
    at `classifier.token_ids` (two of them: the second's minus the first's, when `two_way`)."""
    logits = compute_logits(vector[None])[0].float()
    if classifier.token_ids:
        logits = logits[list(classifier.token_ids)]
        if classifier.two_way:
            logits = logits[1:] - logits[:1]
    return logits
