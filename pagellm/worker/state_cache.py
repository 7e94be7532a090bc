"""The recurrent layers' state slots (core/state.py): each layer's tensors, [slots, *shape], zeroed once.
A request's slot is its row of the persistent batch; a layer reads a slot only after the request's own
first step wrote it (`StateBatch.fresh` says which requests start from nothing), so slots are never
cleared between requests."""

from __future__ import annotations

import torch

from pagellm.core.state import RecurrentKernels
from pagellm.models.context import StateBatch
from pagellm.worker.input_batch import host_to_device
from pagellm.worker.step import StepArrays


def allocate_states(layers: list, slots: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Each recurrent layer's state tensors, by state_idx (`RecurrentLayer.state_spec`)."""
    caches = []
    for layer in layers:
        spec = layer.state_spec()
        caches.append(
            tuple(
                torch.zeros((slots, *shape), dtype=dtype, device=device)
                for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
            )
        )
    return caches


def state_batch(
    step: StepArrays, caches: list[tuple[torch.Tensor, ...]], kernels: RecurrentKernels, device: torch.device
) -> StateBatch | None:
    """What the recurrent layers read of a step (None for a model without): each request's slot, where its
    query starts, whether it starts from nothing (its step runs its whole sequence so far), the layers'
    state tensors (`caches`) and the platform's recurrent kernels."""
    if step.state_slots is None:
        return None
    qsl = step.query_start_loc.tolist()
    return StateBatch(
        slots=host_to_device(step.state_slots, device),
        slot_list=step.state_slots.tolist(),
        query_start_loc=qsl,
        fresh=[int(n) == b - a for n, a, b in zip(step.seq_lens, qsl, qsl[1:], strict=False)],
        caches=caches,
        kernels=kernels,
        drafts=step.state_drafts.tolist() if step.state_drafts is not None else None,
    )
