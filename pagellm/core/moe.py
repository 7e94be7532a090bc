"""The mixture-of-experts contract between models and platforms: stacked expert weights, the activations
experts use, `PackedMoE` (a platform's kernel over repacked weights) and the plain reference every kernel is
checked against.

Layout (fixed, whatever the checkpoint's): `w13` [E, 2I, H] with the gate's I rows first and the up
projection's I rows after them, `w2` [E, H, I], optional biases `w13_bias` [E, 2I] and `w2_bias` [E, H].
Quantized experts (`QUANTIZED_DTYPES`, weight-only) keep that layout in int8 or float8_e4m3fn with one
float32 scale per output row, `w13_scale` [E, 2I] and `w2_scale` [E, H]: expert e's weight is
w13[e] * w13_scale[e, :, None] (symmetric, no zero point).
MXFP4 experts (GPT-OSS checkpoints, `Mxfp4Experts`) keep the checkpoint's blocks in the same row layout:
`w13_blocks` uint8 [E, 2I, H/32, 16] with `w13_scales` [E, 2I, H/32], `w2_blocks` [E, H, I/32, 16] with
`w2_scales` [E, H, I/32] (`pagellm.core.mxfp4` says how they encode the values).
A step's routing is `topk_weights` [T, K] float32 and `topk_ids` [T, K] int64: token t's output is
sum_k topk_weights[t, k] * expert(topk_ids[t, k], x_t).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SILU = "silu"
SWIGLU_OAI = "swiglu_oai"
GELU_TANH = "gelu_pytorch_tanh"
ACTIVATIONS = (SILU, SWIGLU_OAI, GELU_TANH)
"""silu(gate) * up (Llama-style experts); GPT-OSS's clamped SwiGLU; gelu(tanh)(gate) * up."""

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
"""Expert weight dtypes that come with per-row scales."""

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class PackedMoE:
    """Expert weights repacked by `Platform.pack_moe` and the function that runs a step over them:
    (hidden [T, H], topk_weights [T, K] float32, topk_ids [T, K] int64) -> [T, H] in hidden's dtype,
    equal to `fused_experts_reference` up to rounding."""

    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    description: str
    """What runs the experts ("native CPU kernel, AVX2", "Triton"), for the start-up log."""
    weights: tuple[torch.Tensor, ...] = ()
    """The tensors the kernel reads where they are what the layer keeps in memory (the layer registers
    them as its buffers, so the model's bytes count them); empty for a kernel's own repacked copy."""

    def __call__(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.run(hidden, topk_weights, topk_ids)


@dataclass(frozen=True)
class Mxfp4Experts:
    """A layer's MXFP4 experts as the checkpoint stores them, in the layout above."""

    w13_blocks: torch.Tensor
    w13_scales: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales))


def activate(
    gate_up: torch.Tensor,
    activation: str,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """The expert activation of `gate_up` [N, 2I] (gate half first), computed in float32 -> [N, I] float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == SILU:
        return F.silu(gate) * up
    if activation == GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    if activation == SWIGLU_OAI:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(swiglu_alpha * gate)
    raise ValueError(f"unknown expert activation {activation!r}; known: {', '.join(ACTIVATIONS)}")


def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts in plain PyTorch: the step's (token, expert) pairs sorted by expert once, each chosen
    expert run on its tokens (experts no token chose are skipped), weighted and summed per token in float32.
    The fallback where a platform packs nothing, and the oracle its kernels are tested against.

    Quantized experts (scales given) are dequantized one chosen expert at a time, so a step never holds
    more than one expert's weights in the activation dtype: the weight is cast (int8 and e4m3 values are
    exact in bfloat16) and its per-row scale applied to the product, as the dense int8/fp8 layers do."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        x = hidden[rows]
        gate_up = _expert_linear(x, w13, w13_scale, w13_bias, expert)
        act = activate(gate_up, activation).to(hidden.dtype)
        y = _expert_linear(act, w2, w2_scale, w2_bias, expert).float()
        out.index_add_(0, rows, y * weights[start : start + count, None])
        start += count
    return out.to(hidden.dtype)


def _expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    expert: int,
) -> torch.Tensor:
    """x @ weight[expert]^T (+ bias[expert]); with a per-row scale, (x @ q^T) * scale + bias."""
    b = None if bias is None else bias[expert]
    if scale is None:
        return F.linear(x, weight[expert], b)
    y = F.linear(x, weight[expert].to(x.dtype)) * scale[expert].to(x.dtype)
    return y if b is None else y + b
