"""N-gram prompt lookup: find the request's last few tokens earlier in its prompt or output, and propose
the tokens that followed them there. Pays on text that copies itself: code edits, quotes, summaries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagellm.spec_decode.proposer import DraftRequest, Proposer


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens that occurs earlier; [] when none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows start before length - n, so every match has at least one token after it
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            ngram_lookup(np.asarray(r.token_ids, dtype=np.int64), self.min_n, self.max_n, r.num_drafts)
            if r.num_drafts > 0
            else []
            for r in requests
        ]
