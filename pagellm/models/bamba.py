"""Bamba (`BambaForCausalLM`: ibm-ai-platform/Bamba-9B-v2): Granite 4.0-H's structure (granitemoehybrid.py)
under other names: Mamba-2 layers with attention layers at `attn_layer_indices` (transformers'
`layers_block_type` says which), a SwiGLU MLP in every layer, and none of Granite's scalars or routed experts. Attention is Llama's (1 / sqrt(head_dim) scale) with rotary on half of
each head (transformers' Bamba config fixes `partial_rotary_factor` 0.5).

Checkpoint names onto Granite's modules: `feed_forward` is the shared MLP, `pre_ff_layernorm` the
post-attention norm, `final_layernorm` the model's norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagellm.models.granitemoehybrid import GraniteMoeHybridForCausalLM, HybridFields
from pagellm.models.llama import attention_spec

RENAMES = (
    (".feed_forward.", ".shared_mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def bamba_fields(c: Any) -> HybridFields:
    return HybridFields(
        mlp_size=c.intermediate_size,
        rotary=True,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
    )


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    attention_spec = staticmethod(attention_spec)
    fields = staticmethod(bamba_fields)

    def _rename(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        def granite_names() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in RENAMES:
                    name = name.replace(old, new)
                yield name, tensor

        return super()._rename(granite_names())
