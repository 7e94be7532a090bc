"""The int8 KV-cache row format `AttentionSpec.cache_row_size` counts: a row (one token's values of one
KV head) is its head_size values as int8, then their float32 scale (`INT8_SCALE_BYTES`).

Defined in core so that the backends' stores and the selector's timer (`pagellm.core.timing`) write the
same rows.
"""

from __future__ import annotations

import torch

from pagellm.core.dtypes import INT8_SCALE_BYTES


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_size] -> uint8 [..., head_size + INT8_SCALE_BYTES]: round(x / s) as int8 bytes, then s as
    float32 bytes, with s = max |x| / 127 per row (per token and KV head). All-zero rows get s = 0."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, 0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat((values.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def dequantize_int8_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_int8_rows`: int8 or uint8 [..., head_size + INT8_SCALE_BYTES] -> [..., head_size]."""
    rows = rows.view(torch.uint8)
    values = rows[..., :-INT8_SCALE_BYTES].view(torch.int8)
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (values.float() * scale).to(dtype)
