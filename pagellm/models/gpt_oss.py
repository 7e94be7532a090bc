"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b). Llama's decoder (fused q/k/v, tensor and
pipeline parallel split) with GPT-OSS's differences, each as transformers computes it:

- attention sinks: a learned logit per query head joins every softmax (`AttentionSpec.has_sinks`, the
  checkpoint's `self_attn.sinks` loaded into the `Attention` layer's float32 parameter)
- sliding windows on the layers `layer_types` marks (every other one, 128 tokens): two KV cache groups
- YaRN rope from `rope_parameters` (`RotaryEmbedding` takes transformers' own frequencies and attention
  factor); biases on q, k, v and o (`attention_bias`)
- a mixture of experts in every layer: the router is a linear layer with a bias, takes the top k of its
  logits and softmaxes over those k only; the experts have biases and the clamped SwiGLU (`swiglu_oai`).
  The checkpoint's fused `gate_up_proj` [E, H, 2I] interleaves gate and up column by column; `FusedMoE`
  de-interleaves it into its stacked layout
- MXFP4 experts (the released checkpoints, `quantization_config.quant_method` "mxfp4"): each expert
  projection is `<name>_blocks` and `<name>_scales` (`pagellm.core.mxfp4`), read by `FusedMoE`, which keeps
  them packed for a platform kernel that reads them (the CPU's: the checkpoint's bytes in memory) or
  dequantizes them to the model's dtype (exact; 4x the bytes in bf16); the other layers of those
  checkpoints are not quantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.core.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_OAI
from pagellm.models.base import ModelInit, head_size
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX_AFTER_TOPK, Routing
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def gpt_oss_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    # transformers' sliding mask keeps the window's tokens including the query's own, as AttentionSpec does
    sliding = hf_config.layer_types[layer_idx] == "sliding_attention"
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
        sliding_window=hf_config.sliding_window if sliding else None,
        has_sinks=True,
    )


class GptOssDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        alpha, limit = getattr(c, "swiglu_alpha", SWIGLU_ALPHA), getattr(c, "swiglu_limit", SWIGLU_LIMIT)
        if (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            raise ConfigError(
                f"GPT-OSS experts with swiglu_alpha {alpha} and swiglu_limit {limit} are not supported; the "
                f"expert kernels compute the released models' {SWIGLU_ALPHA} and {SWIGLU_LIMIT}"
            )
        return SparseMoeBlock(
            init,
            Routing(c.num_experts_per_tok, SOFTMAX_AFTER_TOPK),
            c.intermediate_size,
            activation=SWIGLU_OAI,
            expert_bias=True,
            router_bias=True,
            mxfp4_experts=_quant_method(c) == "mxfp4",
        )


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    attention_spec = staticmethod(gpt_oss_attention_spec)
    reads_quantization: ClassVar[tuple[str, ...]] = ("mxfp4",)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks").replace(".mlp.router.", ".mlp.gate.")
        return super()._adapt(name, tensor)


def _quant_method(hf_config: Any) -> str | None:
    config = getattr(hf_config, "quantization_config", None) or {}
    return config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
