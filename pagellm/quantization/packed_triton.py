"""A Triton GEMM over int32-packed weights (AWQ and GPTQ): y = x @ dequantize(W), the weight dequantized tile
by tile in registers, never whole in memory. Used on CUDA/ROCm devices; on CPU the torch path runs.

One kernel serves both layouts: GPTQ packs weights along the input dimension (K), AWQ along the output
dimension (N) in its interleaved order; both pack zero points along N. GPTQ names each input row's group
in `g_idx` (act-order), AWQ's groups are consecutive rows. The kernel is jitted on first use in each interpreter
mode, so calls made while `TRITON_INTERPRET=1` is set run it on CPU tensors (tests), the others compiled.
Compiled, its tiles are autotuned over DEVICE_TILES once per (M rounded up to a power of two, N, K) and
dtypes, the first time each comes up; interpreted, it runs INTERPRETER_TILE alone.
"""

from __future__ import annotations

import functools

import torch

from pagellm.core.triton_language import bind_triton_language

tl = None  # triton.language once a kernel is needed (`bind_triton_language`)

MAX_TOKENS = 32
"""Above this many tokens one dequantization feeding the vendor matmul amortises better than the fused
kernel, whose gain is reading 4-bit weights once per decode step."""

DEVICE_TILES = (  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (16, 32, 128, 4, 4),
    (16, 64, 64, 4, 4),
    (16, 64, 128, 4, 3),
    (16, 128, 64, 4, 3),
    (32, 64, 64, 4, 3),
    (32, 128, 64, 8, 3),
)
"""What the autotuner tries on a device. M is at most MAX_TOKENS, so the M tiles are 16 (the smallest tl.dot
takes) or 32; narrow N tiles with deep K tiles keep enough programs busy for a decode's few rows (no split over K),
wider ones suit the larger batches and projections."""
INTERPRETER_TILE = (16, 32, 32, 4, 1)
"""The one tile under TRITON_INTERPRET: timing configs there would measure numpy, slowly, for nothing."""


def tile_configs(interpret: bool) -> list:
    """The `triton.Config`s the kernel is autotuned over: DEVICE_TILES, or INTERPRETER_TILE alone."""
    import triton

    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, n, k, warps, stages in ((INTERPRETER_TILE,) if interpret else DEVICE_TILES)
    ]


def _prune_tiles(configs: list, named_args: dict, **kwargs) -> list:
    """Rows past the batch are masked work: up to 16 rows, only the 16-row tiles are timed."""
    return [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, named_args["M_BUCKET"])]


def triton_runs(weight: torch.Tensor) -> bool:
    """The kernel targets CUDA (and ROCm, which torch also calls cuda) where triton is installed."""
    return weight.device.type == "cuda" and bind_triton_language(globals()) is not None


def packed_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    bits: int,
    zero_offset: int,
    awq: bool,
) -> torch.Tensor:
    """x [..., K] @ W [K, N]; `awq` picks the layout of `qweight` (see the module docstring). Without
    `g_idx`, input row k is in group k // group_size."""
    import triton

    dot_dtype = _dot_dtype(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = scales.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    weights = (t.contiguous() for t in (qweight, qzeros, scales))
    # M_BUCKET, a power of two, is the autotuning key's M: one tuning per bucket, not per batch size
    _kernel()[grid](
        rows, *weights, g_idx if g_idx is None else g_idx.contiguous(), out, m, n, k, group_size,
        triton.next_power_of_2(m), HAS_G_IDX=g_idx is not None, BITS=bits, ZERO_OFFSET=zero_offset, AWQ=awq,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def _dot_dtype(dtype: torch.dtype):
    """The tile dtype for tl.dot: the activation dtype, except bfloat16 under the interpreter (numpy has
    no bfloat16 matmul)."""
    import triton

    bind_triton_language(globals())
    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _kernel():
    """The kernel for the current interpreter mode: `triton.jit` picks interpreted or compiled when it wraps
    the function, so one cached kernel would run a whole process in the mode of its first call."""
    import triton

    return _kernel_in_mode(bool(triton.knobs.runtime.interpret))


@functools.cache
def _kernel_in_mode(interpreting: bool):
    import triton

    bind_triton_language(globals())
    return triton.autotune(
        configs=tile_configs(interpreting),
        key=["M_BUCKET", "N", "K"],
        prune_configs_by={"early_config_prune": _prune_tiles},
    )(triton.jit(_packed_matmul))


def _packed_matmul(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr, M, N, K, group_size, M_BUCKET,
    HAS_G_IDX: tl.constexpr, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, AWQ: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Bit position of column n inside its word along N: AWQ stores column j of 8 in nibble (0,4,1,5,2,6,3,7)[j].
    j = offs_n % PACK
    if AWQ:
        n_shift = ((j % 2) * 4 + j // 2) * BITS
    else:
        n_shift = j * BITS
    # tl.full, not tl.zeros: that is a jit function, which the interpreter cannot call if triton was
    # imported before TRITON_INTERPRET was set
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        tile_mask = mask_k[:, None] & mask_n[None, :]
        if AWQ:
            words = tl.load(
                qweight_ptr + offs_k[:, None] * (N // PACK) + (offs_n // PACK)[None, :], mask=tile_mask
            )
            q = (words >> n_shift[None, :]) & MASK
        else:
            words = tl.load(qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=tile_mask)
            q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            g = offs_k // group_size
        zero_words = tl.load(
            qzeros_ptr + g[:, None] * (N // PACK) + (offs_n // PACK)[None, :], mask=tile_mask
        )
        zeros = ((zero_words >> n_shift[None, :]) & MASK) + ZERO_OFFSET
        scale = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0)
        w = (q - zeros).to(tl.float32) * scale.to(tl.float32)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
