"""Per-sequence recurrent state: what a linear-attention or state-space layer keeps for each running
request instead of a growing KV cache (Gated DeltaNet's conv and delta-rule states, Mamba-2's conv and
SSM states).

A layer's `StateSpec` lists its tensors' per-sequence shapes and dtypes. The model runner allocates each
layer's tensors once, [slots, *shape], one slot per row of its persistent batch: a request holds the slot
of its row from its first scheduled step until it finishes or is preempted, so slots need no allocator of
their own, and the number of rows (`max_num_seqs`) is the number of sequences the states allow. A
preempted request's state is dropped with its row and recomputed from its first token, like its KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's per-sequence tensors: `shapes[i]` of `dtypes[i]`."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
