"""`Attention`: the model-side attention layer; the selected backend does the work.

Under `torch.compile` the layer is one opaque custom op (`pagellm::attention`, or the backend's own
`graph_op`): the backend's Python planning and native kernels stay out of the graph, and everything
between two attention layers (norms, rotary, residuals, MLP) compiles into fused kernels. In eager mode
the layer calls the backend directly, without the dispatcher's overhead.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.context import ForwardContext, ModelInit, get_forward_context


class Attention(nn.Module):
    """Paged attention over flat token batches. q: [T, H*D], k/v: [T, KV*D] -> [T, H*D]."""

    def __init__(self, init: ModelInit, spec: AttentionSpec, layer_idx: int):
        super().__init__()
        self.spec = dataclasses.replace(spec, kv_cache_dtype=init.kv_cache_dtype)
        self.layer_idx = layer_idx
        self.impl = init.attention_backend(self.spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op = self.impl.graph_op or torch.ops.pagellm.attention
            return op(q, k, v, self.layer_idx)
        return self.attend(q, k, v, get_forward_context())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.spec
        out = self.impl.forward(
            q.view(-1, s.num_heads, s.head_size),
            k.view(-1, s.num_kv_heads, s.head_size),
            v.view(-1, s.num_kv_heads, s.head_size),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata_of(self.layer_idx),
        )
        return out.reshape(-1, s.num_heads * s.head_size)


@torch.library.custom_op("pagellm::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Attention layer `layer_idx` of the running model; it writes the KV cache, which is not an argument."""
    ctx = get_forward_context()
    return ctx.attention_layers[layer_idx].attend(q, k, v, ctx)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(q)
