"""OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's decoder (norms after the blocks, RMSNorm over the whole q and k
projections, see `olmo2.py`) with sliding-window attention on the layers `layer_types` marks sliding (three
of every four in the released models, the fourth full), as transformers' `olmo3` computes it.

The rope is per layer type: `rope_parameters` holds one entry for the sliding layers and one for the full
ones, and a config's `rope_scaling` (YaRN in the long-context releases) goes to the full layers only, so
the sliding layers rotate with plain frequencies and the full ones with the scaled ones. Every layer
rotates.

The sliding layers' KV blocks are freed as the window moves (KV cache groups), as for Gemma 3.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.layers.rotary import BY_LENGTH, RotaryEmbedding
from pagellm.models.olmo2 import Olmo2ForCausalLM, Olmo2Model


def rotaries_by_layer_type(hf_config: Any) -> tuple[list[RotaryEmbedding], list[int]]:
    """One rotary embedding per layer type present (built from a copy of the config holding that type's
    parameters, as transformers' Olmo3RotaryEmbedding builds one per type) and, per layer, the index of its
    own. A rope whose frequencies depend on the sequence length is refused: the engine keys the prefix
    cache by the config's one rope, which a rope per type does not give (no OLMo 3 uses one)."""
    params = hf_config.rope_parameters
    types = sorted(set(hf_config.layer_types))
    rotaries = []
    for layer_type in types:
        if params.get(layer_type) is None:
            raise ConfigError(f"OLMo 3: rope_parameters has no entry for the model's {layer_type!r} layers")
        rope_type = params[layer_type].get("rope_type", "default")
        if rope_type in BY_LENGTH:
            raise ConfigError(
                f"OLMo 3 with rope type {rope_type!r} on its {layer_type} layers is not supported: a "
                f"length-dependent rope is supported for models with one rope for every layer"
            )
        config = copy.deepcopy(hf_config)
        config.rope_parameters = dict(params[layer_type])
        rotaries.append(RotaryEmbedding(config))
    return rotaries, [types.index(t) for t in hf_config.layer_types]


class Olmo3Model(Olmo2Model):
    """OLMo 2's layers and norms with a rotary embedding per layer type (`LlamaModel.layer_rope`)."""

    def init_rope(self, hf_config: Any) -> None:
        rotaries, self.layer_rope = rotaries_by_layer_type(hf_config)
        self.rotaries = nn.ModuleList(rotaries)

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [rotary.cos_sin(positions) for rotary in self.rotaries]


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """The windows come from Llama's `attention_spec`, which reads `layer_types` and `sliding_window`."""

    model_class = Olmo3Model
