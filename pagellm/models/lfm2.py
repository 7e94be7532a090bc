"""Liquid AI LFM2 (`Lfm2ForCausalLM`: LFM2-350M, -700M, -1.2B, -2.6B): gated short convolutions
(models/layers/short_conv.py, a conv window per sequence in the state cache) beside attention layers,
`layer_types` saying which ("conv" or "full_attention"; transformers derives it from `full_attn_idxs`).

Each layer: RMSNorm (`operator_norm`), the conv or attention, the residual add, RMSNorm (`ffn_norm`), a
SwiGLU MLP (`w1` gate, `w3` up, `w2` down) and the residual add. Attention is Llama's with per-head RMSNorms on
q and k (`q_layernorm`, `k_layernorm`) before the rotary, no biases and `out_proj` for o_proj; the final norm
is called `embedding_norm`. The MLP's width is `intermediate_size` adjusted as transformers does it
(`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of`). Attention layers are numbered among themselves for the KV cache
(`num_attention_layers`), conv layers likewise for their states. LFM2-MoE (lfm2_moe.py) swaps the MLP for
routed experts after its first dense layers; LFM3 (lfm3.py) adds sliding attention layers, a rope per
attention kind, a gate on the attention's heads and norms on each branch's output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.activation import GatedActivation
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.layers.short_conv import ShortConv
from pagellm.models.llama import LlamaAttention, attention_spec
from pagellm.models.loader import copy_weights

STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
)
RENAMES = (
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".w2.", ".down_proj."),
)
"""Checkpoint names onto the layers' (Llama's attention, the fused MLP)."""


def is_conv_layer(hf_config: Any) -> list[bool]:
    """For each layer, whether it is a short-conv layer (else an attention layer)."""
    return [kind == "conv" for kind in hf_config.layer_types]


def lfm2_mlp_size(c: Any) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it from the config."""
    size = c.intermediate_size
    if c.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if c.block_ffn_dim_multiplier is not None:
            size = int(c.block_ffn_dim_multiplier * size)
            size = c.block_multiple_of * ((size + c.block_multiple_of - 1) // c.block_multiple_of)
    return size


class Lfm2MLP(nn.Module):
    """silu(w1 x) * w3 x, then w2: w1 and w3 fused into gate_up_proj, w2 as down_proj."""

    def __init__(self, init: ModelInit, size: int):
        super().__init__()
        hidden = init.hf_config.hidden_size
        self.gate_up_proj = Linear(hidden, 2 * size, False, init.dtype, init.quant_method, [size, size])
        self.act = GatedActivation("silu")
        self.down_proj = Linear(size, hidden, False, init.dtype, init.quant_method)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class Lfm2Attention(LlamaAttention):
    """Llama's attention with per-head q and k RMSNorms of LFM2's epsilon (`norm_eps`)."""

    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__(init, layer_idx, False, False, attention_spec)
        eps = init.hf_config.norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, init.dtype)
        self.k_norm = RMSNorm(self.head_dim, eps, init.dtype)


class Lfm2DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Lfm2Attention
    """The attention layers' class, built as (init, index among the attention layers); LFM3 gates its output."""

    def __init__(self, init: ModelInit, conv: bool, kind_idx: int, feed_forward: nn.Module):
        super().__init__()
        c = init.hf_config
        self.operator_norm = RMSNorm(c.hidden_size, c.norm_eps, init.dtype)
        if conv:
            self.conv = ShortConv(init, kind_idx, c.conv_L_cache, c.conv_bias)
        else:
            self.self_attn = self.attention_class(init, kind_idx)
        self.is_conv = conv
        self.ffn_norm = RMSNorm(c.hidden_size, c.norm_eps, init.dtype)
        self.feed_forward = feed_forward

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.operator_norm(h)
        h = h + (self.conv(x) if self.is_conv else self.self_attn(x, cos, sin))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    layer_class: type[nn.Module] = Lfm2DecoderLayer

    def __init__(self, init: ModelInit, feed_forward: Any):
        """`feed_forward(init, layer_idx)`: the MLP (or expert block) of each layer."""
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        self.init_rope(c)
        counts = {True: 0, False: 0}
        layers = []
        for i, conv in enumerate(is_conv_layer(c)):
            layers.append(self.layer_class(init, conv, counts[conv], feed_forward(init, i)))
            counts[conv] += 1
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(c.hidden_size, c.norm_eps, init.dtype)

    def init_rope(self, hf_config: Any) -> None:
        """One rope for every attention layer; `layer_rope[i]`: which of `rope()`'s cos/sin layer i takes
        (a model with a rope per layer type, LFM3, builds several)."""
        self.rotary_emb = RotaryEmbedding(hf_config)
        self.layer_rope = [0] * hf_config.num_hidden_layers

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.rotary_emb.cos_sin(positions)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rope(positions)
        h = self.embed_tokens(input_ids)
        for layer, which in zip(self.layers, self.layer_rope, strict=True):
            h = layer(h, *rope[which])
        return self.embedding_norm(h)


class Lfm2ForCausalLM(CausalLM):
    model_class: type[Lfm2Model] = Lfm2Model
    unsplit_layers = (
        "the short-conv layers (models/layers/short_conv.py) have no split of their channels or state"
    )
    attention_spec = staticmethod(attention_spec)  # Llama's: LFM2's layer_types name no window

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.model = self.model_class(init, self.feed_forward)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )

    @staticmethod
    def feed_forward(init: ModelInit, layer_idx: int) -> nn.Module:
        return Lfm2MLP(init, lfm2_mlp_size(init.hf_config))

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return is_conv_layer(hf_config).count(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, self._rename(weights), STACKED)

    def _rename(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if self.tied and name == "lm_head.weight":
                continue
            for old, new in RENAMES:
                name = name.replace(old, new)
            yield name, tensor
