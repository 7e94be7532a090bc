"""What every model class gets at construction, and the interface the model runner relies on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionBackend
from pagellm.core.quant import QuantMethod


@dataclass
class ModelInit:
    """Engine choices a model needs to build its layers."""

    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    attention_backend: type[AttentionBackend]
    block_size: int = 16
    quant_method: QuantMethod | None = None  # an instance, shared by every linear layer


class CausalLM(nn.Module):
    """The model interface. Subclasses build layers in __init__(init: ModelInit) and implement:

    - forward(input_ids [T] int64, positions [T] int64) -> hidden states [T, hidden]
    - compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]
    - load_weights(weights: iterable of (Hugging Face tensor name, tensor))
    Attention layers are `pagellm.models.layers.attention.Attention` with layer_idx 0..L-1.
    """

    def attention_layers(self) -> list[nn.Module]:
        from pagellm.models.layers.attention import Attention

        return sorted((m for m in self.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError
