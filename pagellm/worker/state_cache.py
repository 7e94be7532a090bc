"""The recurrent layers' state slots (core/state.py): each layer's tensors, [slots, *shape], zeroed once.
A request's slot is its row of the persistent batch; a layer reads a slot only after the request's own
first step wrote it (`StateBatch.fresh` says which requests start from nothing), so slots are never
cleared between requests."""

from __future__ import annotations

import torch


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
