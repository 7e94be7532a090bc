"""MiniMax-M2 (`MiniMaxM2ForCausalLM`, MiniMax-M2 and M2.1), as transformers' `minimax_m2` computes it: Llama's
pre-norm decoder with

- RMSNorm over the whole q and k projections (all heads together, before the split into heads), as OLMoE
  has it (olmoe.py's attention: the sums of squares added up over tensor-parallel ranks), then partial
  rotary: `rotary_dim` features of each head rotate (`partial_rotary_factor` in the rope parameters)
- routed experts in every layer (`intermediate_size` wide, no shared expert, no dense layers): sigmoid per
  expert in float32, the choice adds `e_score_correction_bias`, the weights are the un-biased scores of the
  k chosen divided by their sum.

The checkpoints name the MoE block `block_sparse_moe` and each expert's projections w1 (gate), w3 (up),
w2 (down), as Mixtral's; the correction bias is the block's (`block_sparse_moe.e_score_correction_bias`),
here the router's. Layers past `num_hidden_layers` (the multi-token-prediction modules) are skipped.

Fields of the original configs that transformers' code ignores, because every released M2 has them one way,
are refused where they say otherwise: lightning-attention layers in `attn_type_list` (MiniMax-Text-01's),
q/k norms off or per head, shared experts, and routing other than sigmoid.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SIGMOID, Routing
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagellm.models.olmoe import OlmoeAttention


def check_minimax_m2_config(c: Any) -> None:
    """Refuse what transformers' MiniMax-M2 code would silently compute otherwise than the config says."""
    refused = []
    if 0 in (getattr(c, "attn_type_list", None) or ()):
        refused.append("lightning-attention layers (0 in attn_type_list; MiniMax-Text-01's, not M2's)")
    if getattr(c, "use_qk_norm", True) is False or getattr(c, "qk_norm_type", "per_layer") != "per_layer":
        refused.append("q/k norms other than over the whole projection (use_qk_norm, qk_norm_type per_layer)")
    if getattr(c, "shared_intermediate_size", 0):
        refused.append("shared experts (shared_intermediate_size)")
    if getattr(c, "scoring_func", "sigmoid") != "sigmoid":
        refused.append(f"routing by {c.scoring_func!r} (scoring_func; M2's is sigmoid)")
    if refused:
        raise ConfigError(
            "MiniMax-M2 with " + "; ".join(refused) + " is not supported: transformers' MiniMax-M2 code, "
            "which pagellm matches, computes every released M2's shape instead"
        )


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        return SparseMoeBlock(
            init,
            Routing(c.num_experts_per_tok, SIGMOID, renormalize=True),
            c.intermediate_size,
            correction_bias=True,
        )


class MiniMaxM2Model(LlamaModel):
    layer_class = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    model_class = MiniMaxM2Model

    def __init__(self, init: ModelInit):
        check_minimax_m2_config(init.hf_config)
        super().__init__(init)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".mlp.e_score_correction_bias"):
            name = name.replace(".mlp.", ".mlp.gate.")
        return super()._adapt(name, tensor)
