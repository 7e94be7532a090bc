"""`Attention`: the model-side attention layer; the selected backend does the work."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.models.context import get_forward_context


class Attention(nn.Module):
    """Paged attention over flat token batches. q: [T, H*D], k/v: [T, KV*D] -> [T, H*D]."""

    def __init__(self, backend: type[AttentionBackend], spec: AttentionSpec, layer_idx: int):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.impl = backend(spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        s = self.spec
        out = self.impl.forward(
            q.view(-1, s.num_heads, s.head_size),
            k.view(-1, s.num_kv_heads, s.head_size),
            v.view(-1, s.num_kv_heads, s.head_size),
            ctx.kv_caches[self.layer_idx],
            ctx.metadata,
        )
        return out.reshape(-1, s.num_heads * s.head_size)
