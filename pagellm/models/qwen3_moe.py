"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's decoder (per-head q/k RMSNorm) with
routed experts in place of the MLP: softmax over the experts, the top `num_experts_per_tok`, renormalised
with `norm_topk_prob`; no shared expert. `mlp_only_layers` and `decoder_sparse_step` keep some layers
dense."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.native_decode import DenseDecoder, Experts
from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX, Routing
from pagellm.models.llama import (
    STACKED,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    describe_decoder,
    projection_of,
)


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

    def dense_decoder(self) -> DenseDecoder | str:
        """Qwen3's decoder with its experts as the platform packed them (`_experts`)."""
        if type(self) is not Qwen3MoeForCausalLM:
            return f"{type(self).__name__} changes the Qwen3-MoE decoder"
        return describe_decoder(self, _experts)


def _experts(block: nn.Module) -> Experts | str:
    """Softmax routing over packed experts, without a shared expert, expert parallelism or router bias."""
    if type(block) is not SparseMoeBlock or block.shared_expert is not None:
        return "a layer's MLP is neither Llama's nor plain routed experts"
    gate, experts, routing = block.gate, block.experts, block.gate.routing
    plain = (
        routing.scoring == SOFTMAX
        and routing.num_groups == 1
        and routing.scaling_factor == 1.0
        and routing.renormalize_eps == 0.0
    )
    if not plain or gate.bias is not None or gate.e_score_correction_bias is not None:
        return "its router adds a bias, groups or scales the experts' weights"
    if experts.packed is None or experts.expert_parallel:
        return "its experts are not on a native kernel, or are spread over ranks"
    return Experts(projection_of(gate), routing.top_k, routing.renormalize, experts.packed.run)
