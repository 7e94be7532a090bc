"""Mamba-2 (the state-space layers of Granite 4.0-H, Bamba and Nemotron-H): a selective state-space scan with a
state per sequence; each family names the layer's sizes in its config its own way (`Mamba2Shape`).

Per token: `in_proj` gives the output gate z, the scan's inputs x, B and C side by side (xBC), and dt per head;
xBC passes through a causal depthwise conv (kernel K, with bias, SiLU); the scan (mamba_ops.py has the math)
reads x per head with B and C per group of heads; a gated RMSNorm, norm(y * silu(z)) per group, and
`out_proj` finish it. A sequence's state is its conv window (the last K - 1 conv inputs) and the SSM state
[heads, head_dim, d_state], kept in its slot between steps (core/state.py).

The step's conv and scan run in one opaque op, `pagellm::mamba2`, which reads the states from the forward
context and writes them back, as `pagellm::gated_delta_net` does (gated_delta_net.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.state import StateSpec
from pagellm.models.context import ModelInit, get_forward_context
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.mamba_ops import ssd_chunk_scan
from pagellm.models.layers.recurrent import RecurrentLayer
from pagellm.models.layers.recurrent_kernels import complete
from pagellm.models.layers.recurrent_ops import causal_conv1d_prefill


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each of `groups` equal parts of the width, in float32 (transformers'
    MambaRMSNormGated with norm_before_gate=False)."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = (y.float() * F.silu(gate.float())).unflatten(-1, (self.groups, -1))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(y.dtype)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's sizes and options, which each family's config names its own way."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    activation: str
    eps: float
    dt_limit: tuple[float, float]
    """dt's clamp after the softplus, in prefill only (mamba_ops.ssd_chunk_scan)."""

    @classmethod
    def from_config(cls, c: Any, names: str, dt_limit: tuple[float, float]) -> Mamba2Shape:
        """The shape from config `c` whose fields for num_heads .. eps, in this class's order, are `names`
        (space-separated)."""
        values = (getattr(c, name) for name in names.split())
        return cls(*values, dt_limit=(float(dt_limit[0]), float(dt_limit[1])))

    @classmethod
    def from_mamba_fields(cls, c: Any) -> Mamba2Shape:
        """Granite 4.0-H's and Bamba's config fields, dt clamped to `time_step_limit`."""
        limit = getattr(c, "time_step_limit", None) or (0.0, float("inf"))
        return cls.from_config(c, MAMBA_FIELDS, limit)


MAMBA_FIELDS = (
    "mamba_n_heads mamba_d_head mamba_n_groups mamba_d_state mamba_d_conv mamba_chunk_size mamba_conv_bias "
    "mamba_proj_bias hidden_act rms_norm_eps"
)
"""Granite 4.0-H's and Bamba's names of `Mamba2Shape`'s fields (the activation is `hidden_act`)."""


class Mamba2Mixer(RecurrentLayer):
    """One Mamba-2 layer, with the checkpoint names of transformers' Mamba-2 mixers (in_proj, conv1d,
    dt_bias, A_log, D, norm, out_proj); its inner width is heads x head_dim."""

    def __init__(self, init: ModelInit, state_idx: int, shape: Mamba2Shape):
        super().__init__(state_idx)
        hidden = init.hf_config.hidden_size
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.n_groups, self.d_state = shape.n_groups, shape.d_state
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.d_state
        self.kernel_size = shape.conv_kernel
        self.chunk_size = shape.chunk_size
        self.activation = shape.activation
        self.dt_min, self.dt_max = shape.dt_limit
        self.dtype = init.dtype
        self.in_proj = Linear(
            hidden, self.intermediate_size + self.conv_dim + self.num_heads, shape.proj_bias, init.dtype
        )
        # nn.Conv1d's depthwise weight [conv_dim, 1, K] (and bias), as the checkpoint keeps them
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, self.kernel_size, dtype=init.dtype), requires_grad=False
        )
        self.conv1d.bias = (
            nn.Parameter(torch.empty(self.conv_dim, dtype=init.dtype), requires_grad=False)
            if shape.conv_bias
            else None
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=init.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=init.dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=init.dtype), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(self.intermediate_size, self.n_groups, shape.eps, init.dtype)
        self.out_proj = Linear(self.intermediate_size, hidden, shape.proj_bias, init.dtype)

    def state_spec(self) -> StateSpec:
        """The conv window in the model's dtype; the SSM state in float32, as it is computed."""
        return StateSpec(
            ((self.conv_dim, self.kernel_size - 1), (self.num_heads, self.head_dim, self.d_state)),
            (self.dtype, torch.float32),
        )

    def recurrent_flops_per_token(self) -> float:
        """Per head and state element: the decay (1), the dt B x update (2), C h (2)."""
        return 5.0 * self.num_heads * self.head_dim * self.d_state

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, xbc, dt = self.in_proj(h).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        return self.out_proj(self.norm(self.scan(xbc, dt), gate))

    def scan(self, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """The conv and the scan of the step's tokens (x, B, C before the conv; dt before its bias) -> y
        [T, heads * head_dim], through the state cache: the part between the projections, which a family
        with its own (Falcon-H1's multipliers and norms) reuses."""
        return torch.ops.pagellm.mamba2(
            xbc,
            dt,
            self.conv1d.weight.view(self.conv_dim, self.kernel_size),
            self.conv1d.bias,
            self.A_log,
            self.dt_bias,
            self.D,
            self.state_idx,
            self.head_dim,
            self.n_groups,
            self.d_state,
            self.chunk_size,
            self.dt_min,
            self.dt_max,
            self.activation,
        )


@torch.library.custom_op("pagellm::mamba2", mutates_args=())
def _mamba2(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    state_idx: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    chunk_size: int,
    dt_min: float,
    dt_max: float,
    activation: str,
) -> torch.Tensor:
    """The step's conv and scan of recurrent layer `state_idx`: xbc [T, conv_dim] (x, B, C before the conv),
    dt [T, H] -> y [T, H * head_dim]; reads and writes the requests' states in the forward context (none in
    a memory-profiling step: one sequence from zero states, nothing kept)."""
    tokens, num_heads = dt.shape
    A = -A_log.float().exp()
    dt_limit = (dt_min, dt_max)

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [t, conv_dim] -> x [t, H, P], B and C [t, G, N]."""
        x, b, c = x.split([num_heads * head_dim, n_groups * d_state, n_groups * d_state], dim=-1)
        groups = (n_groups, d_state)
        return x.unflatten(-1, (num_heads, head_dim)), b.unflatten(-1, groups), c.unflatten(-1, groups)

    state = get_forward_context().state
    if state is None:  # memory profiling: one sequence from nothing
        conv_state = xbc.new_zeros(xbc.shape[1], conv_weight.shape[1] - 1)
        x, _ = causal_conv1d_prefill(xbc, conv_weight, conv_bias, conv_state, activation)
        zeros = torch.zeros(num_heads, head_dim, d_state, dtype=torch.float32, device=xbc.device)
        x, b, c = split(x)
        return ssd_chunk_scan(x, dt, A, b, c, D, dt_bias, zeros, chunk_size, dt_limit)[0].flatten(1)
    kernels = complete(state.kernels)
    conv_states, ssm_states = state.caches[state_idx]
    if state.decode_only:  # one token per request: every request's update at once
        conv = kernels.conv1d_update(xbc, conv_weight, conv_bias, conv_states, state.slots, activation)
        x, b, c = split(conv)
        return kernels.selective_state_update(x, dt, A, b, c, D, dt_bias, ssm_states, state.slots).flatten(1)
    y = xbc.new_empty(tokens, num_heads, head_dim)
    qsl = state.query_start_loc
    for i, slot in enumerate(state.slot_list):
        rows = slice(qsl[i], qsl[i + 1])
        if state.fresh[i]:
            conv_states[slot].zero_()
            ssm_states[slot].zero_()
        x, conv_states[slot] = kernels.causal_conv1d_prefill(
            xbc[rows], conv_weight, conv_bias, conv_states[slot], activation
        )
        x, b, c = split(x)
        y[rows], ssm_states[slot] = kernels.ssd_chunk_scan(
            x, dt[rows], A, b, c, D, dt_bias, ssm_states[slot], chunk_size, dt_limit
        )
    return y.flatten(1)


@_mamba2.register_fake
def _(
    xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, state_idx, head_dim, n_groups, d_state, chunk_size,
    dt_min, dt_max, activation,
):  # fmt: skip
    return xbc.new_empty(dt.shape[0], dt.shape[1] * head_dim)
