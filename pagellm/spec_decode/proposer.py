"""The proposer interface: drafts for a step's decoding requests, from what the model runner knows.

A proposer is deterministic (it proposes, never samples), which is what lets the rejection sampler treat
each draft as certain (probability 1) and keep the target's distribution exactly. EAGLE/MTP heads fit
the same shape: `observe` sees every step's hidden states, `propose` returns the drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from pagellm.core.attention import AttentionBatch


@dataclass
class DraftRequest:
    """One request that will decode next step."""

    request_id: str
    token_ids: Sequence[int]  # prompt, outputs and this step's new tokens
    num_drafts: int  # at most this many (fewer near max_tokens or max_model_len)
    row: int = -1  # its row in the runner's persistent batch (block table), for proposers with a KV cache


@dataclass
class StepInputs:
    """A target forward's inputs, for proposers that keep state in step with the target's KV cache."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionBatch
    hidden: torch.Tensor  # [T, hidden]: the target's last hidden states (what EAGLE-style heads read)
    rows: np.ndarray | None = None  # [B]: each request's row of the runner's persistent batch
    # [T, len(Proposer.aux_layers) * hidden]: the residual stream entering those layers, where the step
    # ran natively (which reports them); None after the eager forward (the proposer's hooks caught them)
    aux: torch.Tensor | None = None


class Proposer(ABC):
    name: ClassVar[str]
    # the target layers whose incoming residual stream the proposer reads (`StepInputs.aux`)
    aux_layers: tuple[int, ...] = ()

    def observe(self, step: StepInputs) -> None:  # noqa: B027 (optional hook)
        """Called after every target forward with the step's inputs (a draft model keeps its KV in step)."""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Up to `num_drafts` tokens for each request (an empty list: no guess)."""
