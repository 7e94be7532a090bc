"""Checkpoint tensors of routed experts go to their `FusedMoE` layer, the rest to `copy_weights`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.models.loader import Adapt, copy_weights


def copy_weights_with_experts(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Sequence[tuple[str, str, int]] = (),
    adapt: Adapt | None = None,
) -> set[str]:
    """`copy_weights` for a model with `FusedMoE` layers: a tensor named `<layer>.<rest>` (after `adapt`)
    where `<layer>` is one, e.g. `model.layers.3.mlp.experts.7.up_proj.weight`, is that layer's
    `load_checkpoint(rest)`. Returns the parameter names filled, an expert parameter once every expert's
    part of it was."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if adapt is not None:
                adapted = adapt(name, tensor)
                if adapted is None:
                    continue
                name, tensor = adapted
            prefix, found, rest = name.partition(".experts.")
            layer = layers.get(prefix + ".experts") if found else None
            if layer is None:
                yield name, tensor
            else:
                layer.load_checkpoint(rest, tensor)

    loaded = copy_weights(model, others(), stacked)
    return loaded | {
        f"{name}.{param}" for name, layer in layers.items() for param in layer.loaded_parameters()
    }
