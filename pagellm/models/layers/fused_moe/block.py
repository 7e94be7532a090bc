"""`SparseMoeBlock`: the MLP of a mixture-of-experts decoder layer (router, routed experts, optional shared
expert), and which layers have one. Families build it from their config and map their checkpoint names
onto its modules (`gate`, `experts`, `shared_expert`, `shared_expert_gate`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.core.moe import SILU
from pagellm.models.context import ModelInit
from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.models.layers.fused_moe.routing import Routing, select_experts
from pagellm.models.layers.linear import Linear

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where configs give the number of routed experts: Qwen; Mixtral and GPT-OSS; DeepSeek."""


def expert_count(hf_config: Any) -> int:
    """The config's number of routed experts; 0 for a dense model."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has experts rather than a dense MLP: DeepSeek's and GLM-4.5's
    first `first_k_dense_replace` layers are dense, so are Qwen's `mlp_only_layers`, and with Qwen's
    `decoder_sparse_step` s only every s-th layer has experts."""
    if expert_count(hf_config) == 0 or layer_idx < (getattr(hf_config, "first_k_dense_replace", 0) or 0):
        return False
    if layer_idx in (getattr(hf_config, "mlp_only_layers", None) or ()):
        return False
    return (layer_idx + 1) % (getattr(hf_config, "decoder_sparse_step", 1) or 1) == 0


class Router(Linear):
    """The gate: logits x W^T (+ router bias, GPT-OSS) [T, E], replicated on every rank, then
    `select_experts`. `e_score_correction_bias` (DeepSeek-V3) is float32, as transformers keeps it."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        routing: Routing,
        dtype: torch.dtype,
        bias: bool = False,
        correction_bias: bool = False,
    ):
        super().__init__(hidden_size, num_experts, bias, dtype)
        self.routing, self.dtype = routing, dtype
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, K] float32, topk_ids [T, K] int64) for `hidden` [T, H]."""
        logits = self(hidden.to(self.dtype))
        return select_experts(logits, self.routing, self.e_score_correction_bias)


class SparseMoeBlock(nn.Module):
    """Routed experts plus, where the family has one, a shared expert every token runs (DeepSeek's
    `shared_experts`, Qwen2-MoE's `shared_expert` scaled by sigmoid(`shared_expert_gate`(x))).

    Under tensor parallelism the experts and the shared expert each leave a partial sum (the shared
    expert is built with its reduction off), added up by one all-reduce for the whole block."""

    def __init__(
        self,
        init: ModelInit,
        routing: Routing,
        intermediate_size: int,
        *,
        activation: str = SILU,
        expert_bias: bool = False,
        router_bias: bool = False,
        router_dtype: torch.dtype | None = None,
        correction_bias: bool = False,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: bool = False,
        mxfp4_experts: bool = False,
    ):
        super().__init__()
        c = init.hf_config
        num_experts = expert_count(c)
        self.tp = init.parallel.tp
        self.gate = Router(
            c.hidden_size, num_experts, routing, router_dtype or init.dtype, router_bias, correction_bias
        )
        self.experts = FusedMoE(
            num_experts,
            c.hidden_size,
            intermediate_size,
            init.dtype,
            self.tp,
            init.expert_parallel,
            activation,
            expert_bias,
            init.quant_method,
            mxfp4=mxfp4_experts,
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(c.hidden_size, 1, False, init.dtype) if shared_expert_gate else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate.route(hidden)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return self.tp.all_reduce(out)
