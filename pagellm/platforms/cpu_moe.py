"""The native CPU fused-MoE kernel (`cpu_kernels/fused_moe.cpp`): its weight layout, packed once per layer,
and the op a step calls.

The op, `pagellm::cpu_fused_moe`, is defined here with a fake implementation and implemented in C++ by the
kernels' build, so under torch.compile it is one opaque call that never enters Python. The packed layout
(the C++ file's header says it in full): w13 in panels of 8 gate and the matching 8 up rows, w2 in panels
of 16 output rows, each panel k-major so the kernel reads it in one sequential pass; bfloat16 panels
interleave their two 8-column halves so that AVX2 widens them to float32 with a shift and a mask. Quantized
experts (int8, float8_e4m3fn) keep their one byte per weight in panels of the same shape, columns in order,
and their per-row scales become float32 per-column vectors laid out as the biases are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.core.moe import ACTIVATIONS, QUANTIZED_DTYPES, SWIGLU_ALPHA, SWIGLU_LIMIT, PackedMoE
from pagellm.platforms.cpu_huge_pages import huge_page_empty

PANEL = 16
"""Weight columns per packed panel: w13's hold 8 gate and 8 up columns, w2's 16 output columns."""

HALF = PANEL // 2

DTYPES = (torch.float32, torch.bfloat16, *QUANTIZED_DTYPES)
"""Expert weight dtypes the kernel reads (hidden states float32 or bfloat16, independently); the quantized
ones with their scales."""

torch.library.define(
    "pagellm::cpu_fused_moe",
    "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2, Tensor? w13_bias, "
    "Tensor? w2_bias, Tensor? w13_scale, Tensor? w2_scale, str activation, float swiglu_alpha, "
    "float swiglu_limit) -> Tensor",
)


@torch.library.register_fake("pagellm::cpu_fused_moe")
def _(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    activation: str,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [E, R, ...] zero-padded to [E, rows, ...]."""
    extra = rows - weight.shape[1]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(weight.shape[0], extra, *weight.shape[2:])], dim=1)


def _interleave(panels: torch.Tensor) -> torch.Tensor:
    """[..., 2, 8, K] (two 8-column halves of each panel) -> [..., K, 16] in the kernel's order: halves
    side by side for float32, interleaved column by column for bfloat16."""
    if panels.dtype == torch.bfloat16:
        panels = panels.transpose(-3, -2)  # [..., 8, 2, K]: value 2j is column j, 2j + 1 column 8 + j
    panels = panels.flatten(-3, -2).transpose(-1, -2)
    # on 2 MiB pages (`cpu_huge_pages`): model E's bf16 experts, 128-token requests through `pagellm serve`,
    # 27.3-28.5 against 28.3-30.2 ms a token, alternated (Zen 4)
    return huge_page_empty(tuple(panels.shape), panels.dtype).copy_(panels)


def pack_w13(w13: torch.Tensor) -> torch.Tensor:
    """w13 [E, 2I, H] -> [E, ceil(I/8), H, 16]: panel p holds gate rows 8p..8p+7, then up rows 8p..8p+7."""
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    panels = -(-inter // HALF)
    gate = _pad_rows(w13[:, :inter], panels * HALF).view(experts, panels, 1, HALF, hidden)
    up = _pad_rows(w13[:, inter:], panels * HALF).view(experts, panels, 1, HALF, hidden)
    return _interleave(torch.cat([gate, up], dim=2))


def pack_w2(w2: torch.Tensor) -> torch.Tensor:
    """w2 [E, H, I] -> [E, ceil(H/16), I, 16]: panel p holds output rows 16p..16p+15."""
    experts, hidden, inter = w2.shape
    panels = -(-hidden // PANEL)
    return _interleave(_pad_rows(w2, panels * PANEL).view(experts, panels, 2, HALF, inter))


def pack_w13_columns(values: torch.Tensor) -> torch.Tensor:
    """A value per w13 row (bias or scale) [E, 2I] -> float32 [E, 16 ceil(I/8)]: per panel the 8 gate
    values, then the 8 up values, zero-padded."""
    experts, two_i = values.shape
    inter = two_i // 2
    panels = -(-inter // HALF)
    gate = F.pad(values[:, :inter].float(), (0, panels * HALF - inter)).view(experts, panels, 1, HALF)
    up = F.pad(values[:, inter:].float(), (0, panels * HALF - inter)).view(experts, panels, 1, HALF)
    return torch.cat([gate, up], dim=2).reshape(experts, panels * PANEL).contiguous()


def pack_w2_columns(values: torch.Tensor) -> torch.Tensor:
    """A value per w2 row (bias or scale) [E, H] -> float32 [E, 16 ceil(H/16)], zero-padded."""
    hidden = values.shape[1]
    return F.pad(values.float(), (0, -(-hidden // PANEL) * PANEL - hidden)).contiguous()


def _packed(values: torch.Tensor | None, pack) -> torch.Tensor | None:
    return None if values is None else pack(values)


class CpuFusedMoE:
    """A layer's experts in the kernel's layout; called with (hidden [T, H], topk_weights [T, K],
    topk_ids [T, K]) -> [T, H] in hidden's dtype."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        if (w13.dtype in QUANTIZED_DTYPES) != (w13_scale is not None and w2_scale is not None):
            raise ValueError(f"{w13.dtype} experts need both scales exactly when they are quantized")
        self.w13 = pack_w13(w13)
        self.w2 = pack_w2(w2)
        self.w13_bias = _packed(w13_bias, pack_w13_columns)
        self.w2_bias = _packed(w2_bias, pack_w2_columns)
        self.w13_scale = _packed(w13_scale, pack_w13_columns)
        self.w2_scale = _packed(w2_scale, pack_w2_columns)
        self.activation = activation

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.pagellm.cpu_fused_moe(
            hidden,
            topk_weights,
            topk_ids,
            self.w13,
            self.w2,
            self.w13_bias,
            self.w2_bias,
            self.w13_scale,
            self.w2_scale,
            self.activation,
            SWIGLU_ALPHA,
            SWIGLU_LIMIT,
        )


def pack(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    isa: str,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> PackedMoE:
    """The layer's experts on the kernel (which the caller has loaded: it registers the op's CPU code)."""
    kernel = CpuFusedMoE(w13, w2, w13_bias, w2_bias, activation, w13_scale, w2_scale)
    what = f", {str(w13.dtype).removeprefix('torch.')} weight-only" if w13.dtype in QUANTIZED_DTYPES else ""
    return PackedMoE(kernel, f"native CPU kernel, {isa}{what}")
