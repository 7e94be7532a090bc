"""Seed-OSS (`SeedOssForCausalLM`, ByteDance Seed-OSS-36B): the Llama decoder, as transformers' `seed_oss`
computes it, with

- a `head_dim` of its own (128 with a hidden size of 5120 and 80 heads: q is twice as wide as the
  residual stream)
- biases on q/k/v (`attention_bias`, on as released) and a separate switch for o_proj's
  (`attention_out_bias`, off as released), and on the MLP's projections with `mlp_bias`
- dropout after attention and after the MLP (`residual_dropout`), which does nothing at inference.
"""

from __future__ import annotations

from pagellm.models.base import ModelInit
from pagellm.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    SpecFn,
)


class SeedOssAttention(LlamaAttention):
    """o_proj's bias from `attention_out_bias`, not from `attention_bias` as Llama's."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        # read by LlamaAttention.__init__ when it builds o_proj (a plain attribute: settable before it)
        self.o_bias = bool(getattr(init.hf_config, "attention_out_bias", False))
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)


class SeedOssDecoderLayer(LlamaDecoderLayer):
    attention_class = SeedOssAttention


class SeedOssModel(LlamaModel):
    layer_class = SeedOssDecoderLayer


class SeedOssForCausalLM(LlamaForCausalLM):
    model_class = SeedOssModel
