"""Dense linear layers on the native panel kernels: bfloat16 weights on CPUs without AMX, where oneDNN
multiplies them slowly at decode batch sizes or not at all.

On CPUs with AVX-512 BF16 (AMD Zen 4 and 5), `pack_pairs` lays the weight out for
`cpu_kernels/linear_bf16_pairs.cpp`'s `pagellm::cpu_bf16_pair_linear`, which multiplies bfloat16 pairs with
vdpbf16ps. On AVX2-only CPUs, `pack` lays it out for `cpu_kernels/linear_panels.cpp`.

The weight is packed once into 16-column panels, the layout of the fused-MoE kernel's down projection
(`cpu_moe.pack_w2` of a single expert), and stays bfloat16; the op, `pagellm::cpu_panel_linear`, is defined
here with a fake implementation and implemented in C++, so under torch.compile it is one opaque call.

Weight-only int8 and fp8 (e4m3) layers (the `int8` and `fp8` quantization methods on CPU) use the same
panels with one byte per weight and a float32 scale per output column (`pack_quantized`): half the bytes
bfloat16 streams, widened in registers, without the dequantized copy `F.linear` would need every call.
"""

from __future__ import annotations

import torch

from pagellm.core.platform import PackedLinear
from pagellm.platforms import cpu_moe
from pagellm.platforms.cpu_huge_pages import huge_page_empty

torch.library.define(
    "pagellm::cpu_panel_linear",
    "(Tensor x, Tensor weight, Tensor? bias, int out_features, bool fixed_order=False, Tensor? scale=None) -> Tensor",
)


@torch.library.register_fake("pagellm::cpu_panel_linear")
def _(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, *_: bool
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


torch.library.define(
    "pagellm::cpu_bf16_pair_linear", "(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor"
)


@torch.library.register_fake("pagellm::cpu_bf16_pair_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


torch.library.define("pagellm::cpu_bf16_pair_heads", "(Tensor x, Tensor weight, int out_features) -> Tensor")


@torch.library.register_fake("pagellm::cpu_bf16_pair_heads")
def _(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0], out_features))


class PanelLinear:
    """x @ W^T + bias with W in the panel layout (out_features kept: the layout pads it to 16).

    `fixed_order`: each row's result does not depend on the number of rows (batch-invariant mode)."""

    def __init__(self, out_features: int, fixed_order: bool = False):
        self.out_features = out_features
        self.fixed_order = fixed_order

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagellm.cpu_panel_linear(x, weight, bias, self.out_features, self.fixed_order)


class PairLinear:
    """x @ W^T + bias, x bfloat16, with W laid out by `pack_pairs`."""

    def __init__(self, out_features: int):
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagellm.cpu_bf16_pair_linear(x, weight, bias, self.out_features)


def pack_pairs(weight: torch.Tensor) -> PackedLinear:
    """A bfloat16 weight [out, in] as [ceil(out/16), ceil(in/2), 16, 2]: 16-column panels, in each the
    weights of inputs 2i and 2i + 1 side by side, zero-padded (the caller has loaded the kernels)."""
    out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -in_features % 2, 0, -out_features % cpu_moe.PANEL))
    # each pair of inputs as one 32-bit word, so the transpose moves words, not 2-byte halves of them
    # (2.4x faster: model S's weights packed in 0.11 s instead of 0.27 s at start-up)
    words = padded.contiguous().view(torch.int32)
    panels = words.reshape(-1, cpu_moe.PANEL, words.shape[1]).transpose(1, 2)
    # on 2 MiB pages (`cpu_huge_pages`): model M's bf16 decode 9-12% faster a token, S's 4-6% (Zen 4)
    panels = huge_page_empty(tuple(panels.shape), panels.dtype).copy_(panels)
    return PackedLinear(
        panels.view(torch.bfloat16).unflatten(-1, (cpu_moe.PANEL, 2)), PairLinear(out_features)
    )


class PairHeads:
    """x [T, H, in] bfloat16 -> [T, H, out]: each head's rows times its own W^T, W laid out by
    `pack_pair_heads` (the op returns [H, T, out]; the result is its transposed view, as torch.bmm's was)."""

    def __init__(self, out_features: int):
        self.out_features = out_features

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return torch.ops.pagellm.cpu_bf16_pair_heads(x, weight, self.out_features).transpose(0, 1)


def pack_pair_heads(weight: torch.Tensor) -> PackedLinear:
    """bfloat16 per-head weights [H, out, in] (in even) as [H, ceil(out/16), in/2, 16, 2]: each head's
    weight laid out as `pack_pairs` lays out a linear's (the caller has loaded the kernels)."""
    heads, out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -out_features % cpu_moe.PANEL))
    words = padded.contiguous().view(torch.int32)  # [H, out, in / 2]: a pair of inputs a word
    panels = words.reshape(heads, -1, cpu_moe.PANEL, words.shape[2]).transpose(2, 3).contiguous()
    return PackedLinear(
        panels.view(torch.bfloat16).unflatten(-1, (cpu_moe.PANEL, 2)), PairHeads(out_features)
    )


def worth_packing(weight: torch.Tensor) -> bool:
    """At least one whole panel of outputs: a narrower weight (a router over a few experts) would be padded
    to 16 rows, more bytes than it has, for a GEMM F.linear does in microseconds."""
    return weight.shape[0] >= cpu_moe.PANEL


def pack(weight: torch.Tensor, fixed_order: bool = False) -> PackedLinear:
    """A float32 or bfloat16 weight [out, in] in panels [ceil(out/16), in, 16], the same dtype (the caller
    has loaded the kernels: that registers the op's CPU code)."""
    return PackedLinear(cpu_moe.pack_w2(weight.unsqueeze(0))[0], PanelLinear(weight.shape[0], fixed_order))


QUANTIZED = (torch.int8, torch.float8_e4m3fn)
"""Weight dtypes the kernel reads with a per-column scale."""


def pack_quantized(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 or float8_e4m3fn weight [out, in] in panels, and its per-row scales (float32 [out], [out, 1]
    or one value) as the kernel reads them: float32 [16 * panels], zero-padded."""
    rows = weight.shape[0]
    values = scale.float().reshape(-1)
    values = values.expand(rows) if values.numel() == 1 else values
    return cpu_moe.pack_w2(weight.unsqueeze(0))[0], cpu_moe.pack_w2_columns(values.unsqueeze(0))[0]


def quantized_linear(
    x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ (weight * scale)^T + bias for a weight packed by `pack_quantized`, in x's dtype (float32 or
    bfloat16)."""
    return torch.ops.pagellm.cpu_panel_linear(x, panels, bias, out_features, False, scale)
