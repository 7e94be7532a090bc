"""Dense linear layers on the native panel kernel (`cpu_kernels/linear_panels.cpp`): bfloat16 weights on
CPUs where neither pagellm's AMX kernel nor oneDNN multiplies them fast (AVX2-only CPUs).

The weight is packed once into 16-column panels, the layout of the fused-MoE kernel's down projection
(`cpu_moe.pack_w2` of a single expert), and stays bfloat16; the op, `pagellm::cpu_panel_linear`, is defined
here with a fake implementation and implemented in C++, so under torch.compile it is one opaque call.
"""

from __future__ import annotations

import torch

from pagellm.core.platform import PackedLinear
from pagellm.platforms import cpu_moe

torch.library.define(
    "pagellm::cpu_panel_linear", "(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor"
)


@torch.library.register_fake("pagellm::cpu_panel_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PanelLinear:
    """x @ W^T + bias with W in the panel layout (out_features kept: the layout pads it to 16)."""

    def __init__(self, out_features: int):
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagellm.cpu_panel_linear(x, weight, bias, self.out_features)


def worth_packing(weight: torch.Tensor) -> bool:
    """At least one whole panel of outputs: a narrower weight (a router over a few experts) would be padded
    to 16 rows, more bytes than it has, for a GEMM F.linear does in microseconds."""
    return weight.shape[0] >= cpu_moe.PANEL


def pack(weight: torch.Tensor) -> PackedLinear:
    """A float32 or bfloat16 weight [out, in] in panels [ceil(out/16), in, 16], the same dtype (the caller
    has loaded the kernels: that registers the op's CPU code)."""
    return PackedLinear(cpu_moe.pack_w2(weight.unsqueeze(0))[0], PanelLinear(weight.shape[0]))
