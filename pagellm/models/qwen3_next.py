"""Qwen3-Next (`Qwen3NextForCausalLM`, e.g. Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet layers
(models/layers/gated_delta_net.py, a recurrent state per sequence) and gated full attention, one attention
layer in every `full_attention_interval` (`layer_types` says which), with Qwen's routed experts plus a
shared expert scaled by sigmoid(`shared_expert_gate`(x)) in place of most MLPs.

Attention: q_proj gives each head's query and an output gate side by side, q and k get a per-head
(1 + w) RMSNorm, rotary covers `partial_rotary_factor` of each head, and the attention output is multiplied
by sigmoid(gate) before o_proj. Every RMSNorm of the model scales by (1 + w) except the delta net's gated
one. Attention layers are numbered among themselves for the KV cache (`num_attention_layers`), delta-net
layers likewise for their states.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, expert_count, is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import Routing
from pagellm.models.layers.gated_delta_net import GatedDeltaNet
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import GemmaRMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.models.llama import STACKED, LlamaMLP, attention_spec
from pagellm.models.qwen3_moe import softmax_routing

FULL_ATTENTION = "full_attention"


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's kind, "linear_attention" or "full_attention" (the config's `layer_types`, else one full
    attention layer in every `full_attention_interval`)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    interval = hf_config.full_attention_interval
    return [
        FULL_ATTENTION if (i + 1) % interval == 0 else "linear_attention"
        for i in range(hf_config.num_hidden_layers)
    ]


class Qwen3NextAttention(nn.Module):
    def __init__(self, init: ModelInit, attention_idx: int):
        super().__init__()
        c = init.hf_config
        spec = Qwen3NextForCausalLM.attention_spec(c, init.dtype, init.block_size, attention_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(c, "attention_bias", False)
        sizes = [2 * self.q_size, self.kv_size, self.kv_size]  # q_proj: each head's query, then its gate
        self.qkv_proj = Linear(c.hidden_size, sum(sizes), bias, init.dtype, init.quant_method, sizes)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias, init.dtype, init.quant_method)
        self.q_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps, init.dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps, init.dtype)
        self.attn = Attention(init, spec, attention_idx)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(h).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(-1, self.q_size)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        init: ModelInit,
        layer_idx: int,
        kind: str,
        kind_idx: int,
        grouped: bool,
        routing: Routing | None,
    ):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        if kind == FULL_ATTENTION:
            self.self_attn = Qwen3NextAttention(init, kind_idx)
        else:
            self.linear_attn = GatedDeltaNet(init, kind_idx, grouped)
        self.kind = kind
        if is_sparse_layer(c, layer_idx):
            self.mlp = SparseMoeBlock(
                init,
                routing,
                c.moe_intermediate_size,
                shared_expert=LlamaMLP(init, c.shared_expert_intermediate_size, reduce=False),
                shared_expert_gate=True,
            )
        else:
            self.mlp = LlamaMLP(init)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.self_attn(x, cos, sin) if self.kind == FULL_ATTENTION else self.linear_attn(x)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, init: ModelInit, grouped: bool, routing: Routing | None):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        self.rotary_emb = RotaryEmbedding(c)
        counts: dict[str, int] = {}
        layers = []
        for i, kind in enumerate(layer_types(c)):
            kind = FULL_ATTENTION if kind == FULL_ATTENTION else "linear_attention"
            layers.append(Qwen3NextDecoderLayer(init, i, kind, counts.get(kind, 0), grouped, routing))
            counts[kind] = counts.get(kind, 0) + 1
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class Qwen3NextForCausalLM(CausalLM):
    unsplit_layers = (
        "the Gated DeltaNet layers (models/layers/gated_delta_net.py) have no split of their heads or state"
    )
    grouped_projections = True
    """The delta nets' checkpoint layout (`GatedDeltaNet`'s `grouped`): Qwen3-Next's, not Qwen3.5's."""
    renormalize_top_k: bool | None = None
    """Whether the experts' top-k weights are renormalised; None: the config's `norm_topk_prob`."""

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        routing = None  # a dense model's (Qwen3.5)
        if expert_count(c):
            routing = softmax_routing(c)
            if self.renormalize_top_k is not None:
                routing = Routing(c.num_experts_per_tok, renormalize=self.renormalize_top_k)
        self.routing = routing  # the experts' (an MTP layer's route as the model's: spec_decode/qwen_mtp.py)
        self.model = Qwen3NextModel(init, self.grouped_projections, routing)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return layer_types(hf_config).count(FULL_ATTENTION)

    attention_spec = staticmethod(attention_spec)  # Llama's: no sliding window in these configs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, (*STACKED, *GatedDeltaNet.STACKED), self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("mtp.") or (self.tied and name == "lm_head.weight"):
            return None  # the multi-token-prediction layer: read apart (spec_decode/qwen_mtp.py)
        return name, tensor


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 text (`Qwen3_5ForCausalLM`; `Qwen3_5MoeForCausalLM` with experts): Qwen3-Next's layers with
    the delta nets' projections separate in the checkpoint (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    and a dense MLP unless the config has experts. Its multimodal rope gives text tokens one position on
    all three axes, which is the plain rope."""

    grouped_projections = False
    renormalize_top_k = True  # always, with no config field to say so


class Qwen3_5TextOfMultimodal(Qwen3_5ForCausalLM):
    """The text model of a Qwen3.5 multimodal checkpoint (`Qwen3_5ForConditionalGeneration`, the MoE one
    too: how Qwen3.5 ships), for text-only use: the engine runs its `text_config` (engine/setup.py), the
    decoder's weights come under `model.language_model.`, and the vision tower's (`model.visual.`) are not
    read."""

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("model.visual."):
            return None
        return super()._adapt(name.replace("model.language_model.", "model.", 1), tensor)
