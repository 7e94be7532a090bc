"""Rotary position embedding (neox style: the two halves of each head rotate together).

Frequencies come from transformers' own rope functions for the config's `rope_parameters`, so every
static rope type (default, linear, llama3, yarn, ...) matches the reference exactly. cos/sin are computed
once per step from the positions rather than cached, which costs little and has no length limit.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import head_size

_POSITION_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = hf_config.rope_parameters
        rope_type = params.get("rope_type", "default")
        supported = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in _POSITION_DEPENDENT)]
        if rope_type not in supported:
            raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(supported)}")
        if rope_type == "default":
            size = head_size(hf_config)
            exponents = torch.arange(0, size, 2, dtype=torch.float32) / size
            inv_freq, self.scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of [T, head_dim // 2], shared by every layer of one step. Compiled, one
        opaque op: inductor would otherwise recompute them inside every layer's rotation (per head too),
        and on a CPU those sines and cosines cost more than the rotation itself."""
        if torch.compiler.is_compiling():
            return torch.ops.pagellm.rope_cos_sin(positions, self.inv_freq, float(self.scaling))
        return _cos_sin(positions, self.inv_freq, self.scaling)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


@torch.library.custom_op("pagellm::rope_cos_sin", mutates_args=())
def _cos_sin_op(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _cos_sin(positions, inv_freq, scaling)


@_cos_sin_op.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], inv_freq.shape[0])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim // 2]."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
