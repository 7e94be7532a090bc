"""Mixture-of-experts layers on GGUF blocks read in place (`cpu_kernels/gguf_moe.cpp`).

A layer keeps each projection's stacked experts as the file has them (`ffn_gate_exps`, `ffn_up_exps`:
uint8 [E, I, bytes per row of H]; `ffn_down_exps`: [E, H, bytes per row of I]) and the op,
`pagellm::gguf_moe`, runs a step's experts on them directly, as `pagellm::gguf_linear` runs a dense layer
(`platforms/cpu_gguf.py`): the experts take the file's bytes in memory, not a widened copy. Defined here
with a fake implementation and implemented in C++, so under torch.compile it is one opaque call.
"""

from __future__ import annotations

import torch

from pagellm.core.moe import SWIGLU_ALPHA, SWIGLU_LIMIT, PackedMoE
from pagellm.platforms import cpu_gguf

torch.library.define(
    "pagellm::gguf_moe",
    "(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor gate, Tensor up, Tensor down, int[] types, "
    "str activation, float swiglu_alpha, float swiglu_limit) -> Tensor",
)


@torch.library.register_fake("pagellm::gguf_moe")
def _(hidden, topk_weights, topk_ids, gate, up, down, types, activation, swiglu_alpha, swiglu_limit):
    return hidden.new_empty(hidden.shape)


class GgufExperts:
    """A layer's stacked experts as GGUF blocks; called with (hidden [T, H] float32 or bfloat16,
    topk_weights [T, K], topk_ids [T, K]) -> [T, H] in hidden's dtype."""

    def __init__(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: list[int], activation: str
    ):
        self.blocks, self.types, self.activation = (gate, up, down), types, activation

    def __call__(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        alpha, limit = SWIGLU_ALPHA, SWIGLU_LIMIT
        return torch.ops.pagellm.gguf_moe(
            hidden, weights, ids, *self.blocks, self.types, self.activation, alpha, limit
        )


def runs(types: list[int]) -> bool:
    """Whether the kernel reads experts of these GGML types (each must be one `cpu_gguf.has_kernel` names)."""
    return all(cpu_gguf.has_kernel(t) for t in types)


def pack(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: list[int], activation: str, names: str
) -> PackedMoE:
    """The layer's experts on the kernel, over the file's blocks (interleaved where the kernel reads that
    faster, `cpu_gguf.interleave`). `names`: the types' names, for the start-up log."""
    (gate, gate_type), (up, up_type), (down, down_type) = (
        cpu_gguf.interleave(raw, type_id) for raw, type_id in zip((gate, up, down), types, strict=True)
    )
    return PackedMoE(
        GgufExperts(gate, up, down, [gate_type, up_type, down_type], activation),
        f"native CPU kernel on GGUF blocks ({names})",
    )
