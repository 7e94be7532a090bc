"""RMSNorm with an optional fused residual add (the pre-norm decoder pattern)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in float32 and scale in the input dtype, as transformers does."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream and the next block's input in one call."""
        if residual is not None:
            x = x + residual
        return self.forward(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from one, and the scaling by (1 + w) is done in float32
    before the cast back (transformers' Gemma2RMSNorm and Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__(size, eps, dtype)
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
