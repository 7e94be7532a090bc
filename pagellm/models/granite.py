"""IBM Granite (`GraniteForCausalLM`, Granite 3.x dense): the Llama decoder with four scalars from the
config: embeddings times `embedding_multiplier`, each block's output times `residual_multiplier` before it
joins the residual stream, `attention_multiplier` as the softmax scale (instead of head_dim ** -0.5) and
logits divided by `logits_scaling`."""

from __future__ import annotations

import dataclasses

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import ModelInit
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, SpecFn, attention_spec


def granite_attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    spec = attention_spec(hf_config, dtype, block_size, layer_idx)
    return dataclasses.replace(spec, scale=float(hf_config.attention_multiplier))


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.residual_multiplier = float(init.hf_config.residual_multiplier)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.self_attn(h, cos, sin) * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, qkv_bias, qk_norm, spec_fn)
        self.embedding_multiplier = float(init.hf_config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    attention_spec = staticmethod(granite_attention_spec)
    model_class = GraniteModel

    def __init__(self, init: ModelInit):
        super().__init__(init)
        self.logits_scaling = float(init.hf_config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
