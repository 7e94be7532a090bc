"""Qwen2-MoE (`Qwen2MoeForCausalLM`, e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's decoder (q/k/v
bias) with Qwen's routed experts plus a shared expert every token runs, scaled per token by
sigmoid(`shared_expert_gate`(x))."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from pagellm.models.qwen3_moe import softmax_routing


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if not is_sparse_layer(c, layer_idx):
            return LlamaMLP(init)
        return SparseMoeBlock(
            init,
            softmax_routing(c),
            c.moe_intermediate_size,
            shared_expert=LlamaMLP(init, c.shared_expert_intermediate_size, reduce=False),
            shared_expert_gate=True,
        )


class Qwen2MoeModel(LlamaModel):
    layer_class = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    model_class = Qwen2MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)
