"""Shared by the built-in backends: which tokens of a step store their K/V, and where."""

from __future__ import annotations

import torch


def stored_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots to write, indices of the tokens that write them, or None when every token does).

    Negative slots mean "do not store" (padding). Computed once per step, so the per-layer write is a
    single index_copy_; costs one host sync per step."""
    skip = slot_mapping < 0
    if not bool(skip.any()):
        return slot_mapping, None
    tokens = (~skip).nonzero().squeeze(1)
    return slot_mapping[tokens], tokens
