"""Integer weights packed into int32 words (AWQ, GPTQ): unpacking and parameter registration."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.errors import ConfigError


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Every int32 of `packed` expanded into its 32 // bits unsigned values, lowest bits first, along `dim`
    (0 or 1 of a 2-d tensor). The result is int32 (arithmetic shifts, then a mask)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    rows, cols = packed.shape
    if dim == 0:
        return ((packed[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, cols)
    return ((packed[:, :, None] >> shifts) & mask).reshape(rows, -1)


def add_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None
) -> nn.Parameter:
    """Register an empty parameter; `output_dim` tells `Linear.load_shard` which dimension fused shards
    stack along (None: not sharded)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    if output_dim is not None:
        param.output_dim = output_dim
    layer.register_parameter(name, param)
    return param


def check_divisible(method: str, what: str, size: int, by: int, reason: str) -> None:
    if size % by:
        raise ConfigError(f"{method}: {what} {size} is not divisible by {by} ({reason})")


def group_size_of(config: dict, in_features: int, keys: tuple[str, ...] = ("group_size",)) -> int:
    """The config's group size along the input dimension; -1 (or absent) means one group per row."""
    size = next((config[k] for k in keys if config.get(k) is not None), -1)
    return in_features if size == -1 else int(size)
