"""The target's auxiliary hidden states: the residual stream entering chosen decoder layers, caught by
forward pre-hooks while the target runs its (eager) forward, for proposers that read more than the last
hidden state (EAGLE-3 reads three: low, middle, high).

A pre-hook, not a model change: every family built on Llama's skeleton calls its decoder layers as
`layer(h, residual, ...)` with the residual stream h + residual (residual None before the first layer),
so one hook serves them all. A compiled forward would not call Python hooks; the runner keeps the
forward eager when a proposer reads these (`RunnerBuild.compile`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagellm.core.errors import ConfigError


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 layers for a target of `num_layers`: (2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers (`model.model.layers`, Llama's skeleton); a ConfigError otherwise."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"speculative_config: {type(model).__name__} does not keep its decoder layers as model.layers, "
            "so its auxiliary hidden states cannot be read; EAGLE-3 needs a Llama-skeleton target"
        )
    return layers


class AuxHiddenStates:
    """Catches the residual stream entering each of `layer_ids` on every forward of `model`."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ConfigError(
                f"speculative_config: auxiliary hidden state layers {list(layer_ids)} are not all layers of "
                f"the target's {len(layers)} (set eagle_aux_hidden_state_layer_ids in the head's config)"
            )
        self.layer_ids = tuple(layer_ids)
        self.caught: dict[int, torch.Tensor] = {}
        # one hook a layer, however often it is named (vLLM's default repeats one below 6 layers)
        self.handles = [
            layers[i].register_forward_pre_hook(self._hook(i)) for i in sorted(set(self.layer_ids))
        ]

    def _hook(self, layer_id: int):
        def catch(module: nn.Module, args: tuple) -> None:
            h, residual = args[0], args[1] if len(args) > 1 else None
            self.caught[layer_id] = h if residual is None else h + residual

        return catch

    def take(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, len(layer_ids) * hidden]: the last forward's states, concatenated in order."""
        states = [self.caught.get(i) for i in self.layer_ids]
        self.caught.clear()
        if any(s is None or s.shape[0] != num_tokens for s in states):
            raise RuntimeError("the target's forward ran without its auxiliary hidden state hooks")
        return torch.cat(states, dim=-1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
