"""A step's logprobs on the host: the device tensors read once each, then one entry per token."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.sampling.sampler import LogprobsTensors


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
