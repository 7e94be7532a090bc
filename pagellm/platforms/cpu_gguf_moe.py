"""Mixture-of-experts layers on GGUF blocks read in place (`cpu_kernels/gguf_moe.cpp`).

A layer keeps each projection's stacked experts as the file has them (`ffn_gate_exps`, `ffn_up_exps`:
uint8 [E, I, bytes per row of H]; `ffn_down_exps`: [E, H, bytes per row of I]) and the op,
`pagellm::gguf_moe`, runs a step's experts on them directly, as `pagellm::gguf_linear` runs a dense layer
(`platforms/cpu_gguf.py`): the experts take the file's bytes in memory, not a widened copy. Defined here
with a fake implementation and implemented in C++, so under torch.compile it is one opaque call.
"""

from __future__ import annotations

import torch

from pagellm.core.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, Mxfp4Experts, PackedMoE
from pagellm.core.mxfp4 import ggml_rows
from pagellm.platforms import cpu_gguf

MXFP4 = 39
"""GGML's type number for MXFP4 blocks (`gguf.GGMLQuantizationType.MXFP4`)."""

torch.library.define(
    "pagellm::gguf_moe",
    "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor gate, Tensor up, Tensor down, int[] types, "
    "Tensor? w13_bias, Tensor? w2_bias, str activation, float swiglu_alpha, float swiglu_limit) -> Tensor",
)


@torch.library.register_fake("pagellm::gguf_moe")
def _(
    hidden,
    topk_weights,
    topk_ids,
    gate,
    up,
    down,
    types,
    w13_bias,
    w2_bias,
    activation,
    swiglu_alpha,
    swiglu_limit,
):
    return hidden.new_empty(hidden.shape)


class GgufExperts:
    """A layer's stacked experts as GGUF blocks, with their biases where they have them (`w13_bias` [E, 2I],
    gate's then up's, `w2_bias` [E, H]: kept in float32); called with (hidden [T, H] float32 or bfloat16,
    topk_weights [T, K], topk_ids [T, K]) -> [T, H] in hidden's dtype."""

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        types: list[int],
        activation: str,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ):
        self.blocks, self.types, self.activation = (gate, up, down), types, activation
        self.biases = tuple(None if b is None else b.float().contiguous() for b in (w13_bias, w2_bias))

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the kernel reads: the three projections' blocks and the biases."""
        return self.blocks + tuple(b for b in self.biases if b is not None)

    def __call__(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        alpha, limit = SWIGLU_ALPHA, SWIGLU_LIMIT
        return torch.ops.pagellm.gguf_moe(
            hidden, weights, ids, *self.blocks, self.types, *self.biases, self.activation, alpha, limit
        )


def runs(types: list[int]) -> bool:
    """Whether the kernel reads experts of these GGML types (each must be one `cpu_gguf.has_kernel` names)."""
    return all(cpu_gguf.has_kernel(t) for t in types)


def pack(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    types: list[int],
    activation: str,
    names: str,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> PackedMoE:
    """The layer's experts on the kernel, over the file's blocks (interleaved where the kernel reads that
    faster, `cpu_gguf.interleave`). `names`: the types' names, for the start-up log."""
    (gate, gate_type), (up, up_type), (down, down_type) = (
        cpu_gguf.interleave(raw, type_id) for raw, type_id in zip((gate, up, down), types, strict=True)
    )
    experts = GgufExperts(gate, up, down, [gate_type, up_type, down_type], activation, w13_bias, w2_bias)
    return PackedMoE(experts, f"native CPU kernel on GGUF blocks ({names})", experts.tensors)


def pack_mxfp4(
    experts: Mxfp4Experts, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, activation: str
) -> PackedMoE | None:
    """GPT-OSS's MXFP4 experts on the same kernel, rewritten as GGML's MXFP4 blocks (the same bytes, each
    block's scale beside its codes: `core.mxfp4.ggml_rows`), so they take the checkpoint's size; None where
    the kernel is not built (the layer then dequantizes them)."""
    if not runs([MXFP4] * 3):
        return None
    inter = experts.w13_blocks.shape[1] // 2
    gate, up = (
        ggml_rows(experts.w13_blocks[:, rows], experts.w13_scales[:, rows])
        for rows in (slice(0, inter), slice(inter, None))
    )
    down = ggml_rows(experts.w2_blocks, experts.w2_scales)
    kernel = GgufExperts(gate, up, down, [MXFP4] * 3, activation, w13_bias, w2_bias)
    return PackedMoE(kernel, "native CPU kernel on MXFP4 blocks", kernel.tensors)
