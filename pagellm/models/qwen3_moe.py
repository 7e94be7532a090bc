"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's decoder (per-head q/k RMSNorm) with
routed experts in place of the MLP: softmax over the experts, the top `num_experts_per_tok`, renormalised
with `norm_topk_prob`; no shared expert. `mlp_only_layers` and `decoder_sparse_step` keep some layers
dense."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import Routing
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def softmax_routing(hf_config: Any) -> Routing:
    """Qwen's router: softmax, top k, renormalised when the config says `norm_topk_prob`."""
    return Routing(
        hf_config.num_experts_per_tok, renormalize=bool(getattr(hf_config, "norm_topk_prob", False))
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if not is_sparse_layer(c, layer_idx):
            return LlamaMLP(init)
        return SparseMoeBlock(init, softmax_routing(c), c.moe_intermediate_size)


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    model_class = Qwen3MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)
