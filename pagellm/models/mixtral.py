"""Mixtral (`MixtralForCausalLM`, e.g. Mixtral-8x7B): Mistral's decoder with 8 experts per layer, the top 2
by softmax renormalised. Its checkpoints name the MoE block `block_sparse_moe` and each expert's
projections w1 (gate), w3 (up), w2 (down); `FusedMoE` reads those names."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import Routing
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        return SparseMoeBlock(init, Routing(c.num_experts_per_tok, renormalize=True), c.intermediate_size)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return super()._adapt(name.replace(".block_sparse_moe.", ".mlp."), tensor)
