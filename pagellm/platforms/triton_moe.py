"""The fused-MoE experts in Triton, for CUDA and ROCm devices: what `pack_moe` returns there.

A step's (token, expert) pairs are sorted by expert and each expert's run is padded to a whole number of
BLOCK_M rows (`align_to_blocks`), so every row block of the sorted order belongs to one expert. Two grouped
GEMMs then run over those blocks, each program reading its expert's weights and gathering its tokens' rows:
the first multiplies by w13 and keeps gate and up columns in two accumulators, so the activation is applied
in its epilogue and only the [pairs, I] activation is written (in the hidden dtype, as the reference rounds
it); the second multiplies by w2, adds the bias and scales each row by its routing weight. The top-k rows
of each token are then summed. Padding rows are masked; blocks past the step's padded length return at once.
No host synchronisation: buffers are sized by the worst case, so a step can be captured in a CUDA graph.

Tiles come from a small table of known shapes (`TILE_TABLE`) or a default; nothing is autotuned at run time.
The kernel is jitted on first use in each interpreter mode, so calls made while `TRITON_INTERPRET=1` is set
run it on CPU tensors (tests), the others compiled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagellm.core.moe import ACTIVATIONS, GELU_TANH, SILU, SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_OAI, PackedMoE
from pagellm.core.triton_language import bind_triton_language

tl = None  # triton.language once a kernel is needed (`bind_triton_language`)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATION_CODES = {SILU: 0, SWIGLU_OAI: 1, GELU_TANH: 2}
"""The activation as the kernel's constexpr selects it."""


@dataclass(frozen=True)
class Tile:
    """One launch's tiles. `block_n` counts columns of the w13 (gate and up together) and w2 products, so a
    gated program computes block_n // 2 activation columns in two accumulators, the registers of one."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


TILE_TABLE: dict[tuple[int, int, int], tuple[tuple[int, Tile], ...]] = {
    # (E, I, H): ((largest M-bucket, tile), ...), the last entry for every larger M
    (128, 768, 2048): (  # Qwen3-30B-A3B, one rank
        (128, Tile(16, 128, 128, 4, 2)),
        (256, Tile(32, 256, 128, 4, 2)),
        (512, Tile(64, 128, 64, 4, 3)),
        (4096, Tile(128, 256, 64, 8, 4)),
    ),
    (8, 14336, 4096): (  # Mixtral-8x7B, one rank
        (32, Tile(16, 128, 128, 4, 3)),
        (128, Tile(32, 128, 128, 4, 3)),
        (4096, Tile(128, 256, 64, 8, 4)),
    ),
}
"""Tiles for known shapes, keyed by (experts E, intermediate size I, hidden size H) then by the step's
token count rounded up to a power of two (the M-bucket). Taken from vLLM's H200 tunings of its fused-MoE
kernel for these shapes (same tile meaning, one config for both GEMMs), not re-measured here."""


def m_bucket(num_tokens: int) -> int:
    """The step's token count rounded up to a power of two: the table's second key."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def tile_for(num_experts: int, intermediate: int, hidden: int, num_tokens: int, dtype: torch.dtype) -> Tile:
    """The table's tile for this shape and M-bucket (16-bit weights on NVIDIA GPUs, what it was tuned for:
    float32 tiles take twice the shared memory, an AMD CU has less), else the default: 16-row blocks while
    the step has no more tokens than experts (most experts then get a row or two, and padding is the
    waste), 64-row blocks with narrower, shallower tiles above that (vLLM's default rule)."""
    rows = TILE_TABLE.get((num_experts, intermediate, hidden))
    if rows is not None and dtype != torch.float32 and torch.version.hip is None:
        bucket = m_bucket(num_tokens)
        return next((tile for largest, tile in rows if bucket <= largest), rows[-1][1])
    if num_tokens <= num_experts:
        return Tile(16, 32, 64)
    return Tile(64, 64, 32)


def triton_moe_runs(w13: torch.Tensor) -> bool:
    """The kernel targets CUDA (and ROCm, which torch also calls cuda) in the float dtypes, where triton is
    installed."""
    return (
        w13.device.type == "cuda"
        and w13.dtype in KERNEL_DTYPES
        and bind_triton_language(globals()) is not None
    )


def pack_triton_moe(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
) -> PackedMoE:
    """The experts over these weights. The kernel reads the stacked layout as it is (row-major [E, N, K]
    per GEMM, like F.linear), so packing only makes the tensors contiguous."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()

    def run(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_triton(
            hidden, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias
        )

    return PackedMoE(run, "Triton fused MoE")


def align_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's pairs in expert order, each expert's run padded to whole blocks of `block_m` rows:
    (sorted_ids [blocks * block_m] int64: pair index t * K + k, or T * K in padding rows; expert_ids
    [blocks] int64: the expert of each block, past the padded length a value never read;
    num_tokens_post_padded [1] int64). Experts no pair chose get no block. Sized by the worst case,
    T*K + min(E, T*K) * (block_m - 1) rows, with torch ops that do not wait for the device."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: on CUDA it reads the max back
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    # the i-th pair of the sorted order goes to its expert's padded start plus its rank within the expert
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    slots = (padded_ends - padded)[experts] + rank
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-max_rows // block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, slots, order)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_ids, expert_ids, padded_ends[-1:]


def fused_experts_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """`fused_experts_reference` in two Triton grouped GEMMs (see the module docstring); weights and biases
    contiguous, as `pack_triton_moe` leaves them. `tile` overrides `tile_for`'s choice."""
    import triton

    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    intermediate = two_i // 2
    if num_tokens == 0:
        return hidden.new_empty(0, hidden_size)
    tile = tile or tile_for(num_experts, intermediate, hidden_size, num_tokens, hidden.dtype)
    sorted_ids, expert_ids, num_post_padded = align_to_blocks(topk_ids, num_experts, tile.block_m)
    num_pairs = num_tokens * top_k
    hidden = hidden.contiguous()
    act = hidden.new_empty(num_pairs, intermediate)
    out = hidden.new_empty(num_pairs, hidden_size)
    routing = topk_weights.reshape(-1).float().contiguous()
    kernel = _kernel()
    dot_dtype = _dot_dtype(hidden.dtype)
    common = dict(
        SWIGLU_ALPHA=SWIGLU_ALPHA, SWIGLU_LIMIT=SWIGLU_LIMIT, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    num_blocks = expert_ids.numel()
    kernel[(triton.cdiv(intermediate, tile.block_n // 2), num_blocks)](
        hidden, w13, w13_bias, act, sorted_ids, expert_ids, num_post_padded, routing, num_pairs,
        intermediate, hidden_size, ROWS_PER_TOKEN=top_k, GATED=True, ACTIVATION=ACTIVATION_CODES[activation],
        HAS_BIAS=w13_bias is not None, ROUTED=False, **common,
    )  # fmt: skip
    kernel[(triton.cdiv(hidden_size, tile.block_n), num_blocks)](
        act, w2, w2_bias, out, sorted_ids, expert_ids, num_post_padded, routing, num_pairs,
        hidden_size, intermediate, ROWS_PER_TOKEN=1, GATED=False, ACTIVATION=0,
        HAS_BIAS=w2_bias is not None, ROUTED=True, **common,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def _dot_dtype(dtype: torch.dtype):
    """The dtype tl.dot multiplies in: the compute dtype, except float32 for bfloat16 under the
    interpreter, which runs on numpy and has no bfloat16 matmul."""
    bind_triton_language(globals())
    if dtype == torch.bfloat16:
        return tl.float32 if _interpreting() else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _kernel():
    """The kernel for the current interpreter mode: `triton.jit` picks interpreted or compiled when it wraps
    the function, so one cached kernel would run a whole process in the mode of its first call."""
    return _kernel_in_mode(_interpreting())


@functools.cache
def _kernel_in_mode(interpreting: bool):
    import triton

    bind_triton_language(globals())
    return triton.jit(_moe_gemm)


def _moe_gemm(
    a_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, routing_ptr,
    num_pairs, N, K, ROWS_PER_TOKEN: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROUTED: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[pair, n] for one block of one expert's pairs and one tile of N output columns: the rows of `a`
    are gathered per pair (row pair // ROWS_PER_TOKEN), the expert's weight is [N, K] (GATED: [2N, K],
    gate rows then up rows, and the activation of the two products is stored)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // ROWS_PER_TOKEN
    expert = tl.load(expert_ids_ptr + pid_m)
    OUT_N: tl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    W_ROWS: tl.constexpr = 2 if GATED else 1
    offs_n = pid_n * OUT_N + tl.arange(0, OUT_N)
    mask_n = offs_n < N
    w_expert = w_ptr + expert * W_ROWS * N * K
    # tl.full, not tl.zeros: that is a jit function, which the interpreter cannot call if triton was
    # imported before TRITON_INTERPRET was set (the same holds for tl.sigmoid, spelt out below)
    acc = tl.full((BLOCK_M, OUT_N), 0.0, dtype=tl.float32)
    up = tl.full((BLOCK_M, OUT_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + rows[:, None] * K + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0
        )
        a = a.to(DOT_DTYPE)
        w_ptrs = w_expert + offs_n[None, :] * K + offs_k[:, None]
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc += tl.dot(a, w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * K, mask=w_mask, other=0.0)
            up += tl.dot(a, w_up.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert * W_ROWS * N + offs_n
        acc += tl.load(bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias + N, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:  # silu(gate) * up
            acc = acc / (1.0 + tl.exp(-acc)) * up
        elif ACTIVATION == 1:  # GPT-OSS: clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
            acc = tl.minimum(acc, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
            acc = (up + 1.0) * acc / (1.0 + tl.exp(-SWIGLU_ALPHA * acc))
        else:  # gelu(tanh)(gate) * up; (1 + tanh z) / 2 = sigmoid(2z), and 2 * sqrt(2 / pi) = 1.5957691216057308
            acc = acc / (1.0 + tl.exp(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))) * up
    if ROUTED:
        acc = acc * tl.load(routing_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pairs[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & mask_n[None, :],
    )
