"""Baidu ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`, e.g. ERNIE-4.5-21B-A3B-PT), as transformers'
`ernie4_5_moe` computes it: Llama's pre-norm decoder with

- rotary in interleaved pairs (x0, x1), (x2, x3), ... (GPT-J style) rather than in halves: q and k are
  de-interleaved (evens, then odds) and rotated in halves; both move alike, so every q.k is the same
- experts on the layers from `moe_layer_start_index` to `moe_layer_end_index` whose index + 1
  `moe_layer_interval` divides, the dense gated MLP on the others
- a float32 router: softmax over every expert; the choice adds `e_score_correction_bias` (the checkpoint's
  `moe_statics`), the weights are the un-biased scores of the k chosen, renormalised (divided by their sum,
  clamped at `moe_norm_min`, which a sum of k softmax scores never reaches)
- `moe_num_shared_experts` shared experts every token runs, one MLP n times the experts' width.

`use_bias` (biases on every projection and the output head) is refused: no released ERNIE 4.5 MoE sets it.
The checkpoints' multi-token-prediction weights (`mtp_*`) are skipped, as transformers skips them.

Tensor parallelism as Qwen2-MoE: attention by heads, experts by width (or whole with
--enable-expert-parallel), the shared experts and dense layers by width; the router replicated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.deepseek import adapt_moe_names
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX, Routing
from pagellm.models.layers.rotary import apply_rotary, pairs_to_halves
from pagellm.models.llama import (
    STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from pagellm.models.loader import CheckpointSlice


def ernie_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (transformers' Ernie4_5_MoeDecoderLayer's test)."""
    c = hf_config
    end = c.moe_layer_end_index if c.moe_layer_end_index >= 0 else c.num_hidden_layers - 1
    return (layer_idx + 1) % c.moe_layer_interval == 0 and c.moe_layer_start_index <= layer_idx <= end


class Ernie4_5_MoeAttention(LlamaAttention):
    """Llama's attention with the rotary in interleaved pairs, computed in float32 and cast back (as
    transformers' ERNIE 4.5 rotates; the same in float32, closer to it in bf16)."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = pairs_to_halves(q.reshape(-1, self.num_heads, self.head_dim).float())
        k = pairs_to_halves(k.reshape(-1, self.num_kv_heads, self.head_dim).float())
        q, k = apply_rotary(q, cos, sin).to(h.dtype), apply_rotary(k, cos, sin).to(h.dtype)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Ernie4_5_MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Ernie4_5_MoeAttention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if not ernie_sparse_layer(c, layer_idx):
            return LlamaMLP(init)
        shared = c.moe_num_shared_experts or 0
        return SparseMoeBlock(
            init,
            Routing(c.moe_k, SOFTMAX, renormalize=True),
            c.moe_intermediate_size,
            router_dtype=torch.float32,
            correction_bias=True,
            shared_expert=LlamaMLP(init, shared * c.moe_intermediate_size, reduce=False) if shared else None,
        )


class Ernie4_5_MoeModel(LlamaModel):
    layer_class = Ernie4_5_MoeDecoderLayer


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    model_class = Ernie4_5_MoeModel

    def __init__(self, init: ModelInit):
        if getattr(init.hf_config, "use_bias", False):
            raise ConfigError(
                "ERNIE 4.5 MoE with use_bias (biases on every projection and the output head) is not "
                "supported; no released ERNIE 4.5 MoE checkpoint sets it"
            )
        super().__init__(init)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The router's `moe_statics.e_score_correction_bias` [1, E] (under `mlp.`, or `mlp.gate.` as
        transformers names its module) is the router's [E]; `mtp*` weights are skipped."""
        if "mtp" in name:
            return None
        if name.endswith("moe_statics.e_score_correction_bias"):
            prefix = name.partition(".mlp.")[0]
            name = f"{prefix}.mlp.gate.e_score_correction_bias"
            tensor = (tensor.load() if isinstance(tensor, CheckpointSlice) else tensor).reshape(-1)
        return super()._adapt(adapt_moe_names(name), tensor)
