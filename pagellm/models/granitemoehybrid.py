"""IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`: granite-4.0-h-micro, -tiny, -small): a hybrid of Mamba-2
layers (models/layers/mamba2.py, a recurrent state per sequence) and attention layers, `layer_types` saying
which ("mamba" or "attention" in the released configs, which transformers reads as "linear_attention" and
"full_attention").

Every layer has Granite's shared MLP (`shared_mlp`: a fused gate/up `input_linear` and `output_linear`); with
`num_local_experts` > 0 routed experts (`block_sparse_moe`: softmax over the top k router logits) are added to
it. Granite's scalars as in granite.py: embeddings times `embedding_multiplier`, each block's output times
`residual_multiplier`, `attention_multiplier` as the softmax scale, logits divided by `logits_scaling`. The
attention layers rotate q and k only with `position_embedding_type` "rope" (Granite 4.0-H has none). Attention
layers are numbered among themselves for the KV cache (`num_attention_layers`), Mamba layers likewise for
their states.

Bamba (bamba.py) is this structure with other names, no scalars and no experts: the classes here build from
a `HybridFields` that each family reads from its config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import CausalLM, ModelInit, head_size
from pagellm.models.granitemoe import split_granite_experts
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, expert_count
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX_AFTER_TOPK, Routing
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.llama import STACKED, LlamaAttention, LlamaMLP, SpecFn

MAMBA_TYPES = ("mamba", "linear_attention")
"""`layer_types` entries of a Mamba layer: the released configs' name, and transformers' for it."""


def is_mamba_layer(hf_config: Any) -> list[bool]:
    """For each layer, whether it is a Mamba layer (else an attention layer)."""
    return [kind in MAMBA_TYPES for kind in hf_config.layer_types]


@dataclass(frozen=True)
class HybridFields:
    """What the layers below read from a family's config (routed experts: `expert_count`, 0 for none)."""

    mlp_size: int
    """Width of the MLP every layer has (Granite's shared MLP)."""
    rotary: bool
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float


def granite_hybrid_fields(c: Any) -> HybridFields:
    return HybridFields(
        mlp_size=c.shared_intermediate_size,
        rotary=c.position_embedding_type == "rope",
        embedding_multiplier=float(c.embedding_multiplier),
        residual_multiplier=float(c.residual_multiplier),
        logits_scaling=float(c.logits_scaling),
    )


def granite_hybrid_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
        scale=float(hf_config.attention_multiplier),
    )


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, mamba: bool, kind_idx: int, fields: HybridFields, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        if mamba:
            self.mamba = Mamba2Mixer(init, kind_idx, Mamba2Shape.from_mamba_fields(c))
        else:
            self.self_attn = LlamaAttention(init, kind_idx, c.attention_bias, False, spec_fn)
        self.is_mamba = mamba
        self.shared_mlp = LlamaMLP(init, fields.mlp_size)
        self.block_sparse_moe = (
            SparseMoeBlock(init, Routing(c.num_experts_per_tok, SOFTMAX_AFTER_TOPK), c.intermediate_size)
            if expert_count(c)
            else None
        )
        self.residual_multiplier = fields.residual_multiplier

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.mamba(x) if self.is_mamba else self.self_attn(x, cos, sin)
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return h + out * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, init: ModelInit, fields: HybridFields, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        self.embedding_multiplier = fields.embedding_multiplier
        self.rotary_emb = RotaryEmbedding(c) if fields.rotary else None
        counts = {True: 0, False: 0}
        layers = []
        for mamba in is_mamba_layer(c):
            layers.append(GraniteMoeHybridDecoderLayer(init, mamba, counts[mamba], fields, spec_fn))
            counts[mamba] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions) if self.rotary_emb is not None else (None, None)
        h = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class GraniteMoeHybridForCausalLM(CausalLM):
    unsplit_layers = "the Mamba-2 mixers (models/layers/mamba2.py) have no split of their heads or state"
    attention_spec = staticmethod(granite_hybrid_attention_spec)
    fields = staticmethod(granite_hybrid_fields)

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        fields = self.fields(c)
        self.model = GraniteMoeHybridModel(init, fields, self.attention_spec)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )
        self.logits_scaling = fields.logits_scaling

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return is_mamba_layer(hf_config).count(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight) / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, self._rename(weights), STACKED)

    def _rename(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's Granite names onto the layers': the shared MLP's `input_linear` (gate rows, then
        up rows) is the fused `gate_up_proj`; the routed experts' names as Granite MoE's
        (`split_granite_experts`)."""
        for name, tensor in split_granite_experts(weights):
            if self.tied and name == "lm_head.weight":
                continue
            if ".shared_mlp." in name:
                yield (
                    name.replace(".input_linear.", ".gate_up_proj.").replace(
                        ".output_linear.", ".down_proj."
                    ),
                    tensor,
                )
            else:
                yield name, tensor
