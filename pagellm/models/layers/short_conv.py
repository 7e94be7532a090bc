"""LFM2's gated short convolution: in_proj gives three gates B, C and x side by side; B * x passes through a
causal depthwise conv of a few taps (`conv_L_cache`, no activation), C gates its output, and out_proj
finishes it. A sequence's state is the conv window alone, its last K - 1 inputs [hidden, K-1], kept in its
slot between steps (core/state.py) as Mamba-2 keeps its conv window (mamba2.py).

The conv runs in one opaque op, `pagellm::short_conv`, which reads the window from the forward context and
writes it back, through the platform's recurrent kernels: Mamba-2's and Gated DeltaNet's conv kernels
(`conv1d_update` for decode steps, `causal_conv1d_prefill` for prefill) with no activation."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.state import StateSpec
from pagellm.models.context import ModelInit, get_forward_context
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.recurrent import RecurrentLayer
from pagellm.models.layers.recurrent_kernels import complete
from pagellm.models.layers.recurrent_ops import causal_conv1d_prefill


class ShortConv(RecurrentLayer):
    """One gated short-conv layer, with the checkpoint names of transformers' Lfm2ShortConv (in_proj, conv,
    out_proj); `bias` is on all three, as `conv_bias` puts it there."""

    def __init__(self, init: ModelInit, state_idx: int, kernel_size: int, bias: bool):
        super().__init__(state_idx)
        hidden = init.hf_config.hidden_size
        self.hidden_size, self.kernel_size, self.dtype = hidden, kernel_size, init.dtype
        self.in_proj = Linear(hidden, 3 * hidden, bias, init.dtype)
        # nn.Conv1d's depthwise weight [hidden, 1, K] (and bias), as the checkpoint keeps them
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(
            torch.empty(hidden, 1, kernel_size, dtype=init.dtype), requires_grad=False
        )
        self.conv.bias = (
            nn.Parameter(torch.empty(hidden, dtype=init.dtype), requires_grad=False) if bias else None
        )
        self.out_proj = Linear(hidden, hidden, bias, init.dtype)

    def state_spec(self) -> StateSpec:
        """The conv window, in the model's dtype."""
        return StateSpec(((self.hidden_size, self.kernel_size - 1),), (self.dtype,))

    def recurrent_flops_per_token(self) -> float:
        """Per channel: a multiply-add per tap, and the two gates."""
        return (2.0 * self.kernel_size + 2.0) * self.hidden_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        weight = self.conv.weight.view(self.hidden_size, self.kernel_size)
        y = torch.ops.pagellm.short_conv(b * x, weight, self.conv.bias, self.state_idx)
        return self.out_proj(c * y)


@torch.library.custom_op("pagellm::short_conv", mutates_args=())
def _short_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state_idx: int
) -> torch.Tensor:
    """The step's causal conv of recurrent layer `state_idx`: x [T, D] -> y [T, D]; reads and writes the
    requests' conv windows in the forward context (none in a memory-profiling step: one sequence from a zero
    window, nothing kept)."""
    state = get_forward_context().state
    if state is None:  # memory profiling: one sequence from nothing
        return causal_conv1d_prefill(x, weight, bias, x.new_zeros(x.shape[1], weight.shape[1] - 1), None)[0]
    kernels = complete(state.kernels)
    (windows,) = state.caches[state_idx]
    if state.decode_only:  # one token per request: every request's update at once
        return kernels.conv1d_update(x, weight, bias, windows, state.slots, None)
    y = torch.empty_like(x)
    qsl = state.query_start_loc
    for i, slot in enumerate(state.slot_list):
        rows = slice(qsl[i], qsl[i + 1])
        if state.fresh[i]:
            windows[slot].zero_()
        y[rows], windows[slot] = kernels.causal_conv1d_prefill(x[rows], weight, bias, windows[slot], None)
    return y


@_short_conv.register_fake
def _(x, weight, bias, state_idx):
    return torch.empty_like(x)
