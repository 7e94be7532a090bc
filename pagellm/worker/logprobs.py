"""A step's logprobs on the host: the device tensors read once each, then one entry per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.sampling.sampler import LogprobsTensors, compute_prompt_logprobs
from pagellm.worker.input_batch import PreparedStep, host_to_device
from pagellm.worker.step import StepResult


@dataclass
class LogprobLists:
    """A step's `LogprobsTensors` read to the host once, as lists (one transfer per tensor, not one per
    element: each read of a device tensor waits for the device)."""

    token_logprobs: list[float]
    token_ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    @classmethod
    def read(cls, t: LogprobsTensors) -> LogprobLists:
        return cls(
            t.token_logprobs.tolist(), t.token_ranks.tolist(), t.topk_ids.tolist(), t.topk_logprobs.tolist()
        )


def row_logprobs(lp: LogprobLists, row: int, k: int, token_id: int) -> dict[int, tuple[float, int]]:
    """The chosen token first, then the top k: token id -> (logprob, rank)."""
    entry = {token_id: (lp.token_logprobs[row], lp.token_ranks[row])}
    for j, (top_id, top_logprob) in enumerate(
        zip(lp.topk_ids[row][:k], lp.topk_logprobs[row][:k], strict=True)
    ):
        entry.setdefault(top_id, (top_logprob, j + 1))
    return entry


def prompt_logprobs(
    hidden: torch.Tensor,
    step: PreparedStep,
    result: StepResult,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> None:
    """Logprobs of the prompt tokens this step's rows predict (position p predicts token p + 1), for
    all the requests that asked at once: one logits computation (`compute_logits`: the runner's, which the
    other tensor-parallel ranks follow) and one read to the host."""
    prompt_lp, cu, starts = step.prompt_logprobs, step.cu, step.starts
    rows, targets, counts = [], [], []
    for i, request in prompt_lp:
        start = starts[i]
        end = min(start + int(cu[i + 1] - cu[i]), request.num_prompt_tokens)
        last = min(end, request.num_prompt_tokens - 1)
        count = max(last - start, 0)
        rows.append(np.arange(cu[i], cu[i] + count))
        targets += request.prompt_token_ids[start + 1 : start + 1 + count]
        counts.append(count)
    lp = None
    if targets:
        k = max(request.sampling_params.prompt_logprobs for _, request in prompt_lp)
        logits = compute_logits(hidden.index_select(0, host_to_device(np.concatenate(rows), device)))
        tensors = compute_prompt_logprobs(
            logits, host_to_device(np.array(targets, dtype=np.int64), device), k
        )
        lp = LogprobLists.read(tensors)
    row = 0
    for (i, request), count in zip(prompt_lp, counts, strict=True):
        k = request.sampling_params.prompt_logprobs
        entries: list = [None] if starts[i] == 0 else []
        entries += [row_logprobs(lp, row + j, k, targets[row + j]) for j in range(count)]
        row += count
        result.prompt_logprobs[request.request_id] = entries
