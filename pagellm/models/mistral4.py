"""Mistral 4 (`Mistral4ForCausalLM`, Mistral Small 4): DeepSeek-V3's Multi-head Latent Attention and
mixture of experts (`deepseek.py`), with Ministral 3's position-scaled queries, as transformers' `mistral4`
computes it. What differs from DeepSeek-V3:

- the query: after rotary, the whole query (nope and rope features) is multiplied by 1 + beta * log(1 +
  floor(position / original_max_position_embeddings)) (`layers/position_scale.py`, beta the rope
  parameters' `llama_4_scaling_beta`); here it scales the absorbed query, the same thing since it is
  linear. The latent KV cache is DeepSeek's.
- the router (transformers' Mistral4TopkRouter): softmax over the experts, no correction bias; with
  `n_group` groups a group scores the sum of its two best softmax scores (V3's rule without the bias), the
  top k of the `topk_group` best groups' experts are chosen, their softmax scores renormalised with
  `norm_topk_prob` (+1e-20) and scaled by `routed_scaling_factor`. The router runs in the model's dtype,
  as transformers runs it (DeepSeek's is float32).
- which layers have experts: every layer from `first_k_dense_replace` on (no `moe_layer_freq`).
- the checkpoint's experts are stacked, as transformers 5 holds and saves them for this family:
  `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (`split_stacked_experts`);
  per-expert names load too.
- the rope is the config's YaRN over `qk_rope_head_dim` features (`partial_rotary_factor` qk_rope /
  (qk_nope + qk_rope), which the config sets), in interleaved pairs where `rope_interleave` (its default);
  the softmax scale takes mscale(factor, mscale_all_dim) squared, as DeepSeek's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.deepseek import (
    RENORMALIZE_EPS,
    STACKED,
    DeepseekDecoderLayer,
    DeepseekModel,
    DeepseekV3ForCausalLM,
)
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts, split_stacked_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX, Routing
from pagellm.models.layers.position_scale import PositionScaledLayer, PositionScaledQueries
from pagellm.models.llama import LlamaMLP


def mistral4_routing(hf_config: Any) -> Routing:
    """transformers' Mistral4TopkRouter (see the module's docstring)."""
    c = hf_config
    return Routing(
        c.num_experts_per_tok,
        SOFTMAX,
        renormalize=bool(c.norm_topk_prob),
        num_groups=c.n_group or 1,
        topk_groups=c.topk_group or 1,
        scaling_factor=float(c.routed_scaling_factor),
        renormalize_eps=RENORMALIZE_EPS,
        group_top2=True,
    )


def mistral4_moe_block(init: ModelInit) -> SparseMoeBlock:
    """Routed experts and `n_shared_experts` shared experts as one MLP of n x moe_intermediate_size."""
    c = init.hf_config
    shared = c.n_shared_experts or 0
    return SparseMoeBlock(
        init,
        mistral4_routing(c),
        c.moe_intermediate_size,
        shared_expert=LlamaMLP(init, shared * c.moe_intermediate_size, reduce=False) if shared else None,
    )


class Mistral4DecoderLayer(PositionScaledLayer, DeepseekDecoderLayer):
    """DeepSeek's layer (MLA, dense MLP or experts) handing the queries' position scale to attention."""

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        if layer_idx < (init.hf_config.first_k_dense_replace or 0):
            return LlamaMLP(init)
        return mistral4_moe_block(init)


class Mistral4Model(PositionScaledQueries, DeepseekModel):
    layer_class = Mistral4DecoderLayer


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Parallel as DeepSeek-V3: attention heads split over tensor-parallel ranks (each holding the whole
    latent cache), the experts by width or whole, the shared experts and dense MLPs by width; pipeline
    parallel by layers. The query scale is per token, the same on every rank and stage."""

    model_class = Mistral4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, split_stacked_experts(weights), STACKED, self._adapt)
