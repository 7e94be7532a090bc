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
from collections.abc import Callable
from dataclasses import dataclass, fields

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


@dataclass(frozen=True)
class RecurrentKernels:
    """A platform's kernels for recurrent layers (`Platform.recurrent_kernels`); a field left None runs the
    plain-torch reference in `pagellm.models.layers.recurrent_ops` / `mamba_ops`, whose docstrings define
    the math and the layouts each kernel must match up to rounding.

    Decode kernels take the whole state cache and the step's slots and update the slots' states in place,
    so that a fast path reads and writes each state once instead of gathering the states into a batch and
    scattering them back (what the reference does, with `index_select` and `index_copy_`):

    - `conv1d_update(x [B, D], weight [D, K], bias [D] | None, conv_states [S, D, K-1], slots [B] int64,
      activation: str | None) -> y [B, D]`;
    - `gated_delta_rule_update(q [B, H, Dk], k [B, H, Dk], v [B, H, Dv], g [B, H], beta [B, H],
      states [S, H, Dk, Dv] float32, slots [B]) -> o [B, H, Dv]`;
    - `selective_state_update(x [B, H, P], dt [B, H], A [H], B [B, G, N], C [B, G, N], D [H], dt_bias [H],
      states [S, H, P, N] float32, slots [B]) -> y [B, H, P]`.

    Prefill kernels have their reference's signature, one sequence (or prefill chunk) at a time:
    `causal_conv1d_prefill`, `chunk_gated_delta_rule`, `ssd_chunk_scan`."""

    conv1d_update: Callable[..., torch.Tensor] | None = None
    gated_delta_rule_update: Callable[..., torch.Tensor] | None = None
    selective_state_update: Callable[..., torch.Tensor] | None = None
    causal_conv1d_prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    chunk_gated_delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    ssd_chunk_scan: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def describe(self) -> str:
        """Which kernels replace the reference, for the start-up log."""
        names = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        return ", ".join(names) if names else "none (plain torch)"
