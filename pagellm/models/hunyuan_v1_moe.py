"""Tencent Hunyuan MoE (`HunYuanMoEV1ForCausalLM`, Hunyuan-A13B), as transformers' `hunyuan_v1_moe`
computes it: Llama's pre-norm decoder with

- per-head q/k RMSNorm (`query_layernorm`, `key_layernorm`) applied after the rotary, not before it as in
  Qwen3
- NTK-alpha rope: a `dynamic` rope with an `alpha` only stretches the base, theta x alpha^(d / (d - 2)),
  for every length alike (so it is the plain rope on that base, not the length-dependent dynamic NTK)
- in every layer, a shared MLP every token runs beside routed experts, both `intermediate_size` wide: a
  float32 router, softmax over the experts, the top `moe_topk` (one number, or one per layer),
  renormalised.

The original configs carry fields transformers' code does not read, since the released model has them one
way; where a config says otherwise it is refused: cross-layer attention (`use_cla`: layers sharing another
layer's KV), no q/k norms, no rotary, no shared MLP, more than one shared expert, experts of another width
than `intermediate_size` (`moe_intermediate_size`), dense layers (`moe_layer_num_skipped`), MLP biases, or
an expert count per layer.

Tensor parallelism as Qwen2-MoE: attention by heads (the per-head norms need no exchange), the experts by
width (or whole with --enable-expert-parallel), the shared MLP by width; the router replicated.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit, head_size
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX, Routing
from pagellm.models.layers.rotary import apply_rotary
from pagellm.models.llama import (
    STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

CHECKPOINT_NAMES = (
    (".self_attn.query_layernorm.", ".self_attn.q_norm."),
    (".self_attn.key_layernorm.", ".self_attn.k_norm."),
    (".mlp.gate.wg.", ".mlp.gate."),
    (".mlp.shared_mlp.", ".mlp.shared_expert."),
)
"""Hunyuan's module names -> this model's."""


def _each(value: Any) -> list:
    """A config field that is one value or one per layer, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_hunyuan_config(c: Any) -> None:
    """Refuse the original config fields that say otherwise than what transformers' code computes."""
    width = c.intermediate_size
    refused = {
        "cross-layer attention (use_cla)": bool(getattr(c, "use_cla", False)),
        "no q/k norms (use_qk_norm false)": getattr(c, "use_qk_norm", True) is False,
        "no rotary (use_rotary_pos_emb false)": getattr(c, "use_rotary_pos_emb", True) is False,
        "no shared MLP (use_mixed_mlp_moe false)": getattr(c, "use_mixed_mlp_moe", True) is False,
        "other than one shared expert (num_shared_expert)": any(
            n != 1 for n in _each(getattr(c, "num_shared_expert", 1))
        ),
        f"experts of another width than intermediate_size {width} (moe_intermediate_size)": any(
            w != width for w in _each(getattr(c, "moe_intermediate_size", width))
        ),
        "dense layers (moe_layer_num_skipped)": bool(getattr(c, "moe_layer_num_skipped", 0)),
        "MLP biases (mlp_bias)": bool(getattr(c, "mlp_bias", False)),
        "an expert count per layer (num_experts a list)": isinstance(c.num_experts, (list, tuple)),
    }
    found = [what for what, present in refused.items() if present]
    if found:
        raise ConfigError(
            "Hunyuan MoE with " + "; ".join(found) + " is not supported: transformers' HunYuanMoEV1 code, "
            "which pagellm matches, computes the released Hunyuan-A13B's shape instead"
        )


def hunyuan_rope_config(hf_config: Any) -> Any:
    """The config with a `dynamic` rope that has an `alpha` turned into the plain rope on the stretched
    base, as transformers' HunYuanMoEV1RotaryEmbedding computes it ("ntk_alpha"); any other rope as it is."""
    params = hf_config.rope_parameters or {}
    if params.get("rope_type") != "dynamic" or not params.get("alpha"):
        return hf_config
    dim = head_size(hf_config)
    config = copy.copy(hf_config)
    theta = params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


class HunYuanMoEV1Attention(LlamaAttention):
    """Llama's attention with its per-head q/k norms after the rotary."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos, sin))
        k = self.k_norm(apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin))
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class HunYuanMoEV1DecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanMoEV1Attention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        top_k = c.moe_topk if isinstance(c.moe_topk, int) else c.moe_topk[layer_idx]
        return SparseMoeBlock(
            init,
            Routing(top_k, SOFTMAX, renormalize=True),
            c.intermediate_size,
            router_dtype=torch.float32,
            shared_expert=LlamaMLP(init, c.intermediate_size, reduce=False),
        )


class HunYuanMoEV1Model(LlamaModel):
    layer_class = HunYuanMoEV1DecoderLayer

    def init_rope(self, hf_config: Any) -> None:
        super().init_rope(hunyuan_rope_config(hf_config))


class HunYuanMoEV1ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    model_class = HunYuanMoEV1Model

    def __init__(self, init: ModelInit):
        check_hunyuan_config(init.hf_config)
        super().__init__(init)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        for theirs, ours in CHECKPOINT_NAMES:
            name = name.replace(theirs, ours)
        return super()._adapt(name, tensor)
