"""OPT: learned positions offset by 2, q/k/v fused at load, pre- or post-LayerNorm blocks (350m is post),
optional projections between the embedding width and the hidden size, tied LM head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import CausalLM, ModelInit, head_size
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.loader import copy_weights

POSITION_OFFSET = 2
STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2))


def _layer_norm(init: ModelInit) -> nn.LayerNorm:
    c = init.hf_config
    return nn.LayerNorm(c.hidden_size, elementwise_affine=c.layer_norm_elementwise_affine, dtype=init.dtype)


def attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_attention_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
    )


class OPTAttention(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.hidden_size = c.hidden_size
        size, bias = c.hidden_size, c.enable_bias
        self.qkv_proj = Linear(size, 3 * size, bias, init.dtype, init.quant_method, [size] * 3)
        self.out_proj = Linear(c.hidden_size, c.hidden_size, c.enable_bias, init.dtype, init.quant_method)
        spec = attention_spec(c, init.dtype, init.block_size, layer_idx)
        self.attn = Attention(init, spec, layer_idx)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split(self.hidden_size, dim=-1)
        return self.out_proj(self.attn(q, k, v))


class OPTDecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.pre_norm = c.do_layer_norm_before
        self.self_attn = OPTAttention(init, layer_idx)
        self.self_attn_layer_norm = _layer_norm(init)
        self.fc1 = Linear(c.hidden_size, c.ffn_dim, c.enable_bias, init.dtype, init.quant_method)
        self.act = get_activation(c.activation_function)
        self.fc2 = Linear(c.ffn_dim, c.hidden_size, c.enable_bias, init.dtype, init.quant_method)
        self.final_layer_norm = _layer_norm(init)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self._residual(h, self.self_attn_layer_norm, self.self_attn)
        return self._residual(h, self.final_layer_norm, lambda x: self.fc2(self.act(self.fc1(x))))

    def _residual(self, h: torch.Tensor, norm: nn.Module, block) -> torch.Tensor:
        if self.pre_norm:
            return h + block(norm(h))
        return norm(h + block(h))


class OPTDecoder(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.word_embed_proj_dim, init.dtype)
        num_positions = c.max_position_embeddings + POSITION_OFFSET
        self.embed_positions = Embedding(num_positions, c.hidden_size, init.dtype)
        width, hidden = c.word_embed_proj_dim, c.hidden_size
        self.project_in = Linear(width, hidden, False, init.dtype) if width != hidden else None
        self.project_out = Linear(hidden, width, False, init.dtype) if width != hidden else None
        has_final_norm = c.do_layer_norm_before and not c._remove_final_layer_norm
        self.final_layer_norm = _layer_norm(init) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(init, i) for i in range(c.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            h = layer(h)
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        self.decoder = OPTDecoder(init)


class OPTForCausalLM(CausalLM):
    attention_spec = staticmethod(attention_spec)
    unsplit_layers = "OPT's decoder layers (models/opt.py) and its projections in and out have no split"

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.model = OPTModel(init)
        self.tied = bool(getattr(c, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head = self.model.decoder.embed_tokens
        else:
            self.lm_head = Linear(c.word_embed_proj_dim, c.vocab_size, False, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decoder(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Some OPT checkpoints name the decoder without the `model.` prefix."""
        if self.tied and name == "lm_head.weight":
            return None
        if name.startswith("decoder."):
            name = "model." + name
        return name, tensor
