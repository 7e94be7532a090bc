"""`Attention`: the model-side attention layer; the selected backend does the work.

Under `torch.compile` the layer is one opaque custom op (`pagellm::attention`, or the backend's own
`graph_op`): the backend's Python planning and native kernels stay out of the graph, and everything
between two attention layers (norms, rotary, residuals, MLP) compiles into fused kernels. In eager mode
the layer calls the backend directly, without the dispatcher's overhead.

A spec with `has_sinks` gives the layer a `sinks` parameter (float32, one logit per query head of this
rank), which the model's loader fills from the checkpoint's `...self_attn.sinks` (a tensor-parallel rank
takes its heads' slice, `narrow_checkpoint`); the layer hands it to the backend's `forward` each call.

A `latent_kv` spec (MLA) takes k as the cached row and v as a view of its first `v_size` elements, and
returns `v_size` elements per head.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.context import ForwardContext, ModelInit, get_forward_context


class Attention(nn.Module):
    """Paged attention over flat token batches. q: [T, H*D], k: [T, KV*D], v: [T, KV*Dv] -> [T, H*Dv] (Dv =
    the spec's `v_size`, D unless the spec is latent)."""

    def __init__(self, init: ModelInit, spec: AttentionSpec, layer_idx: int):
        super().__init__()
        self.spec = dataclasses.replace(
            spec, kv_cache_dtype=init.kv_cache_dtype, batch_invariant=init.batch_invariant
        )
        self.layer_idx = layer_idx
        # the graph's attention op finds its layer by this tensor, not a constant, so that every layer's
        # trace is the same and one compiled layer serves them all (worker/regional.py); on the CPU
        # whatever the device: the op reads it on the host
        self.register_buffer(
            "layer_index", torch.tensor(layer_idx, dtype=torch.int64, device="cpu"), persistent=False
        )
        self.impl = init.attention_backend(self.spec)
        self.tp_rank = init.parallel.tp.rank
        self.sinks = (
            nn.Parameter(torch.zeros(spec.num_heads, dtype=torch.float32), requires_grad=False)
            if spec.has_sinks
            else None
        )

    def narrow_checkpoint(self, attr: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This tensor-parallel rank's query heads of the checkpoint's sinks (all of them on one rank)."""
        heads = self.spec.num_heads
        if attr != "sinks" or tensor.shape[0] == heads:
            return tensor
        return tensor.narrow(0, self.tp_rank * heads, heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op = self.impl.graph_op or torch.ops.pagellm.attention
            return op(q, k, v, self.layer_index)
        return self.attend(q, k, v, get_forward_context())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.spec
        args = (
            q.view(-1, s.num_heads, s.head_size),
            k.view(-1, s.num_kv_heads, s.head_size),
            v.view(-1, s.num_kv_heads, s.v_size),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata_of(self.layer_idx),
        )
        # only specs with sinks pass them: a backend without the argument runs every other spec
        out = (
            self.impl.forward(*args, sinks=self.sinks) if self.sinks is not None else self.impl.forward(*args)
        )
        return out.reshape(-1, s.num_heads * s.v_size)


@torch.library.custom_op("pagellm::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor
) -> torch.Tensor:
    """Attention layer `layer_index` (a one-element tensor) of the running model; it writes the KV cache,
    which is not an argument."""
    ctx = get_forward_context()
    return ctx.attention_layers[int(layer_index)].attend(q, k, v, ctx)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor) -> torch.Tensor:
    # [T, H * Dv]: the query's width with each head's D turned into Dv (k and v have the same KV heads)
    return q.new_empty(q.shape[0], q.shape[1] // k.shape[1] * v.shape[1])
