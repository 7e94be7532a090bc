"""Liquid AI LFM2-MoE (`Lfm2MoeForCausalLM`: LFM2-8B-A1B): LFM2's short-conv and attention layers (lfm2.py)
with routed experts in place of the MLP after the first `num_dense_layers` layers (which keep a SwiGLU MLP
`intermediate_size` wide, not adjusted as LFM2's is).

The router (`gate`) scores each expert by the sigmoid of its logit; with `use_expert_bias` the choice of the
top k adds the block's `expert_bias` and the weights do not (DeepSeek-V3's correction bias, here the
router's); with `norm_topk_prob` the k weights are divided by their sum plus 1e-6, then all are times
`routed_scaling_factor`. The experts (`experts.{e}.w1/w3/w2`, `moe_intermediate_size` wide) run on the
`FusedMoE` layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SIGMOID, Routing
from pagellm.models.lfm2 import STACKED, Lfm2ForCausalLM, Lfm2MLP

RENORMALIZE_EPS = 1e-6
"""What transformers' Lfm2MoeTopKRouter adds to the k weights' sum before dividing by it."""


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    @staticmethod
    def feed_forward(init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if layer_idx < c.num_dense_layers:
            return Lfm2MLP(init, c.intermediate_size)
        routing = Routing(
            c.num_experts_per_tok,
            SIGMOID,
            renormalize=bool(c.norm_topk_prob),
            scaling_factor=float(c.routed_scaling_factor),
            renormalize_eps=RENORMALIZE_EPS,
        )
        return SparseMoeBlock(init, routing, c.moe_intermediate_size, correction_bias=bool(c.use_expert_bias))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, self._rename(weights), STACKED)

    def _rename(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """LFM2's names, and the block's `expert_bias` as its router's correction bias."""
        for name, tensor in super()._rename(weights):
            yield (
                name.replace(".feed_forward.expert_bias", ".feed_forward.gate.e_score_correction_bias"),
                tensor,
            )
