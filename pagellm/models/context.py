"""The per-step forward context: what attention layers need besides their inputs.

The model runner sets it around each forward; `Attention` layers read it. This keeps model code free of
batch plumbing (the same idea as nano-vllm's context).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    metadata: Any  # what the attention backend's build_metadata returned for this step
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by Attention.layer_idx
    attention_layers: Sequence[Any] = ()  # the `Attention` layers by layer_idx, for the compiled graph's op
    lora_groups: Sequence[tuple[int, Any]] = ()  # (LoRA slot, token indices) of the step's adapter tokens


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention layer called outside set_forward_context(); the model runner sets it")
    return _context


@contextmanager
def set_forward_context(
    metadata: Any,
    kv_caches: list[torch.Tensor],
    attention_layers: Sequence[Any] = (),
    lora_groups: Sequence[tuple[int, Any]] = (),
) -> Iterator[None]:
    global _context
    previous, _context = _context, ForwardContext(metadata, kv_caches, attention_layers, lora_groups)
    try:
        yield
    finally:
        _context = previous


def lora_groups() -> Sequence[tuple[int, Any]]:
    """The current step's LoRA groups; none outside a step."""
    return _context.lora_groups if _context is not None else ()
