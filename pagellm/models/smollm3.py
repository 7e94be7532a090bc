"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder where some layers use no rotary embedding (NoPE):
`no_rope_layers[i]` is 1 where layer i rotates q and k, 0 where it does not (every fourth layer in the
released models). A sliding window applies only with `use_sliding_window`, on the layers `layer_types`
marks sliding."""

from __future__ import annotations

import dataclasses

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import ModelInit
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, SpecFn, attention_spec


def smollm3_attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    spec = attention_spec(hf_config, dtype, block_size, layer_idx)
    sliding = getattr(hf_config, "use_sliding_window", False) and (
        hf_config.layer_types[layer_idx] == "sliding_attention"
    )
    return dataclasses.replace(spec, sliding_window=hf_config.sliding_window if sliding else None)


class NoPEWhereOff:
    """Mixed in before a decoder layer class whose __init__ sets `use_rope` (SmolLM3's, EXAONE 4's): a
    layer without rope hands its attention no cos and sin, so it attends without positions."""

    use_rope: bool

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_rope:
            cos = sin = None
        return super().forward(h, residual, cos, sin)


class SmolLM3DecoderLayer(NoPEWhereOff, LlamaDecoderLayer):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.use_rope = bool(init.hf_config.no_rope_layers[layer_idx])


class SmolLM3Model(LlamaModel):
    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    attention_spec = staticmethod(smollm3_attention_spec)
    model_class = SmolLM3Model
