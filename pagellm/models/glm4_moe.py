"""GLM-4.5 (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6), as transformers' `glm4_moe` computes it:
Llama's decoder (fused q/k/v, tensor and pipeline parallel split) with

- GQA attention with `head_dim` apart from hidden / heads, q/k/v biases (`attention_bias`) but none on
  o_proj, optional per-head q/k RMSNorm before the rotary (`use_qk_norm`), and partial rotary
  (`partial_rotary_factor`: the first half of each head rotates, neox style, the rest passes through)
- DeepSeek-V3's mixture of experts (`deepseek_moe_block`): dense layers before `first_k_dense_replace`,
  then routed experts chosen by sigmoid scores plus `e_score_correction_bias` over `n_group` groups,
  weighted by the un-biased scores (renormalised with `norm_topk_prob`) times `routed_scaling_factor`,
  and `n_shared_experts` shared experts every token runs.

The checkpoints hold `num_nextn_predict_layers` multi-token-prediction layers after the decoder layers
(`model.layers.<num_hidden_layers>...`); they belong to no pipeline stage's layers, so the loader skips
them; speculative decoding's `mtp` method loads the first as a draft head (`spec_decode/mtp.py`).

Tensor parallelism as Qwen2-MoE: attention by heads, the experts by width (or whole with
--enable-expert-parallel), the shared experts by width, one all-reduce per MoE block; the router and its
correction bias replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.deepseek import adapt_moe_names, deepseek_moe_block
from pagellm.models.layers.fused_moe.block import is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.llama import (
    STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    SpecFn,
)


class Glm4MoeAttention(LlamaAttention):
    """q/k norms where the config's `use_qk_norm` says so; o_proj without a bias."""

    o_bias = False

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, bool(init.hf_config.use_qk_norm), spec_fn)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Glm4MoeAttention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(init.hf_config, layer_idx):
            return LlamaMLP(init)
        return deepseek_moe_block(init)


class Glm4MoeModel(LlamaModel):
    layer_class = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(LlamaForCausalLM):
    model_class = Glm4MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return super()._adapt(adapt_moe_names(name), tensor)
