"""Liquid AI LFM3 (`Lfm3ForCausalLM`): LFM2's gated short convolutions beside attention (lfm2.py), with what
transformers' `lfm3` changes, each as its modeling_lfm3.py computes it:

- two attention kinds by `layer_types`: "sliding_attention" (a window of `sliding_window` tokens, the KV
  blocks behind it freed as for Gemma 3) and "full_attention"; "conv" layers are LFM2's short convs
- a rope per attention kind (`rope_parameters` keyed by layer type, as OLMo 3's): as released, the sliding
  layers rotate with plain frequencies and the full ones with Gemma 4's "proportional" rope (the first
  `partial_rotary_factor` of each head's frequency pairs rotate, the rest have a zero frequency);
  transformers' own rope functions build both
- attention is Qwen3's (per-head q/k RMSNorms named `q_norm`/`k_norm`, `o_proj`, `attention_bias` on all
  four projections) with, under `use_attention_gate`, each head's output scaled by sigmoid(`g_proj` x) of
  the layer's normalised input before o_proj
- under `use_sandwich_norm`, RMSNorms on the operator's and the MLP's outputs (`post_operator_norm`,
  `post_ffn_norm`) before each residual add
- the SwiGLU MLP (`w1`/`w3`/`w2`) is `intermediate_size` wide, not adjusted as LFM2's is

Length-dependent ropes (dynamic, longrope) are refused: their per-token lengths are wired for a model with
one rope (rotary.py); no LFM3 uses one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import BY_LENGTH, RotaryEmbedding, apply_rotary
from pagellm.models.lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2MLP, Lfm2Model
from pagellm.models.llama import LlamaAttention, attention_spec

ATTENTION_TYPES = ("full_attention", "sliding_attention")
"""The attention layer types, in the order their rotaries are built (transformers' `_rope_type_labels`)."""


def attention_layer_indices(hf_config: Any) -> list[int]:
    """The model-wide index of each attention layer, in the order the KV cache numbers them."""
    return [i for i, kind in enumerate(hf_config.layer_types) if kind != "conv"]


def lfm3_attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    """Llama's spec of attention layer `layer_idx` (numbered among the attention layers), its window read
    from the layer's own `layer_types` entry."""
    return attention_spec(hf_config, dtype, block_size, attention_layer_indices(hf_config)[layer_idx])


def rope_config(hf_config: Any, layer_type: str) -> Any:
    """A copy of the config holding one layer type's rope parameters, which RotaryEmbedding reads."""
    params = (hf_config.rope_parameters or {}).get(layer_type)
    if params is None:
        raise ConfigError(f"LFM3: rope_parameters has no entry for the model's {layer_type!r} layers")
    rope_type = params.get("rope_type", "default")
    if rope_type in BY_LENGTH:
        raise ConfigError(
            f"LFM3 with rope type {rope_type!r} on its {layer_type} layers is not supported: a "
            f"length-dependent rope is supported for models with one rope for every layer"
        )
    config = copy.deepcopy(hf_config)
    config.rope_parameters = dict(params)
    return config


class Lfm3Attention(LlamaAttention):
    """Qwen3's attention (q/k norms) with LFM3's window per layer and a sigmoid gate per head."""

    def __init__(self, init: ModelInit, layer_idx: int):
        c = init.hf_config
        bias = bool(getattr(c, "attention_bias", False))
        super().__init__(init, layer_idx, bias, True, lfm3_attention_spec)
        gated = getattr(c, "use_attention_gate", False)
        self.g_proj = (
            Linear(c.hidden_size, self.num_heads, False, init.dtype, init.quant_method) if gated else None
        )

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        if self.g_proj is None:
            return super().forward(h, cos, sin)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        heads = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        gated = heads.view(-1, self.num_heads, self.head_dim) * torch.sigmoid(self.g_proj(h)).unsqueeze(-1)
        return self.o_proj(gated.reshape(-1, self.q_size))


class Lfm3DecoderLayer(Lfm2DecoderLayer):
    """LFM2's layer with LFM3's attention and, under `use_sandwich_norm`, a norm on each branch's output."""

    attention_class = Lfm3Attention

    def __init__(self, init: ModelInit, conv: bool, kind_idx: int, feed_forward: nn.Module):
        super().__init__(init, conv, kind_idx, feed_forward)
        c = init.hf_config

        def branch_norm() -> nn.Module:
            return RMSNorm(c.hidden_size, c.norm_eps, init.dtype) if c.use_sandwich_norm else nn.Identity()

        self.post_operator_norm = branch_norm()
        self.post_ffn_norm = branch_norm()

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.operator_norm(h)
        h = h + self.post_operator_norm(self.conv(x) if self.is_conv else self.self_attn(x, cos, sin))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Lfm3Model(Lfm2Model):
    """LFM2's skeleton with LFM3's layers and a rope per attention layer type."""

    layer_class = Lfm3DecoderLayer

    def init_rope(self, hf_config: Any) -> None:
        """A rotary per attention kind present, as transformers' Lfm3RotaryEmbedding builds them; the conv
        layers are handed the first, which they do not read. Another layer type is refused: LFM2's layer
        would build it as attention."""
        types = [t for t in ATTENTION_TYPES if t in hf_config.layer_types]
        unknown = set(hf_config.layer_types) - {"conv", *ATTENTION_TYPES}
        if unknown:
            raise ConfigError(
                f"LFM3: layer types {sorted(unknown)} are not supported (only conv, {', '.join(ATTENTION_TYPES)})"
            )
        self.rotaries = nn.ModuleList([RotaryEmbedding(rope_config(hf_config, t)) for t in types])
        self.layer_rope = [types.index(t) if t in types else 0 for t in hf_config.layer_types]

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [rotary.cos_sin(positions) for rotary in self.rotaries]


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Checkpoint names are LFM2's but for the attention's: Qwen3's (pagellm's own) and the gate, which
    checkpoints call `gate_proj` (transformers renames it `g_proj` on loading and back on saving)."""

    model_class = Lfm3Model
    attention_spec = staticmethod(lfm3_attention_spec)

    @staticmethod
    def feed_forward(init: ModelInit, layer_idx: int) -> nn.Module:
        return Lfm2MLP(init, init.hf_config.intermediate_size)

    def _rename(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super()._rename(weights):
            yield name.replace(".self_attn.gate_proj.", ".self_attn.g_proj."), tensor
