"""Checkpoint tensors of routed experts go to their `FusedMoE` layer, the rest to `copy_weights`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.models.loader import Adapt, CheckpointSlice, copy_weights


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


def split_stacked_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers 5's stacked expert tensors, as its `save_pretrained` writes them for families it has no
    per-expert conversion for (Mistral 4): `<layer>.experts.gate_up_proj` [E, 2I, H] (each expert's gate
    rows, then its up rows) and `<layer>.experts.down_proj` [E, H, I], as the per-expert
    `experts.{e}.gate_proj.weight`, `up_proj.weight` and `down_proj.weight` that `FusedMoE` reads (views of
    the stacked tensor, read whole, one layer at a time). GPT-OSS's transposed, interleaved layout is
    another (`FusedMoE` reads it as it is); other tensors pass unchanged."""
    for name, tensor in weights:
        head, found, rest = name.rpartition(".experts.")
        if not found or rest not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        stacked = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
        for e, expert in enumerate(stacked):
            if rest == "down_proj":
                yield f"{head}.experts.{e}.down_proj.weight", expert
            else:
                gate, up = expert.chunk(2, dim=0)
                yield f"{head}.experts.{e}.gate_proj.weight", gate
                yield f"{head}.experts.{e}.up_proj.weight", up
