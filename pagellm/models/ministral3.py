"""Ministral 3 (`Ministral3ForCausalLM`; shipped as the text model of `Mistral3ForConditionalGeneration`, see
`mistral3.py`): Mistral's decoder (GQA, `head_dim` apart from hidden / heads, an optional sliding window on
every layer) with YaRN rope and one addition, as transformers' `ministral3` computes it: after rotary, each
query is multiplied by 1 + beta * log(1 + floor(position / original_max_position_embeddings))
(`layers/position_scale.py`; beta is the rope parameters' `llama_4_scaling_beta`). Keys are not scaled,
so the KV cache is Mistral's.

The scale depends on the position only, so it is computed once per step beside cos and sin and handed to
every layer with them (`PositionScaledQueries`).
"""

from __future__ import annotations

import dataclasses

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.models.layers.position_scale import PositionScaledLayer, PositionScaledQueries, scale_query
from pagellm.models.layers.rotary import apply_rotary
from pagellm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    attention_spec,
)


def ministral3_attention_spec(
    hf_config, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    """Mistral's: `sliding_window` (where set) on every layer. transformers' Ministral 3 ignores
    `layer_types` (it warns that such a config wants another class), so this does too."""
    spec = attention_spec(hf_config, dtype, block_size, layer_idx)
    return dataclasses.replace(spec, sliding_window=getattr(hf_config, "sliding_window", None))


class Ministral3Attention(LlamaAttention):
    """Llama's attention with the query scaled by its position after rotary."""

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin)
        q = scale_query(q, q_scale)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Ministral3DecoderLayer(PositionScaledLayer, LlamaDecoderLayer):
    attention_class = Ministral3Attention


class Ministral3Model(PositionScaledQueries, LlamaModel):
    layer_class = Ministral3DecoderLayer


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Tensor and pipeline parallel as Llama (the scale is per token, the same on every rank)."""

    attention_spec = staticmethod(ministral3_attention_spec)
    model_class = Ministral3Model
