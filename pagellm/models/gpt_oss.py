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
  projection is `<name>_blocks` and `<name>_scales` (`pagellm.core.mxfp4`), dequantized here at load to
  the model's dtype (exact), so the experts then run like unquantized ones and take 4x (bf16) the memory
  of the packed weights; the other layers of those checkpoints are not quantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.core.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_OAI
from pagellm.core.mxfp4 import dequantize_mxfp4
from pagellm.models.base import ModelInit, head_size
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX_AFTER_TOPK, Routing
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagellm.models.loader import CheckpointSlice

MXFP4_PARTS = ("_blocks", "_scales")


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
        )


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    attention_spec = staticmethod(gpt_oss_attention_spec)
    reads_quantization: ClassVar[tuple[str, ...]] = ("mxfp4",)

    def __init__(self, init: ModelInit):
        super().__init__(init)
        self.dtype = init.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, dequantized_experts(weights, self.dtype), STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks").replace(".mlp.router.", ".mlp.gate.")
        return super()._adapt(name, tensor)


def dequantized_experts(
    weights: Iterable[tuple[str, torch.Tensor | CheckpointSlice]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """The checkpoint's tensors with each MXFP4 pair `<name>_blocks` [E, N, K/32, 16] and `<name>_scales`
    [E, N, K/32] (for the weight [E, N, K] that GPT-OSS multiplies as x @ W^T) replaced by `<name>` in the
    layout transformers' unquantized checkpoints keep, [E, K, N] (x @ W), dequantized to `dtype`. The first
    of a pair is held until its partner comes (they may be in different files); other tensors pass."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        part = next((p for p in MXFP4_PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        base = name.removesuffix(part)
        pending[name] = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
        blocks, scales = pending.get(base + "_blocks"), pending.get(base + "_scales")
        if blocks is None or scales is None:
            continue
        del pending[base + "_blocks"], pending[base + "_scales"]
        yield base, dequantize_mxfp4(blocks, scales, dtype).transpose(-1, -2)
    if pending:
        raise ConfigError(
            f"MXFP4 tensors without their blocks or scales in the checkpoint: {sorted(pending)}"
        )
