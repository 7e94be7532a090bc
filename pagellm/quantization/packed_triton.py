"""A Triton GEMM over int32-packed weights (AWQ and GPTQ): y = x @ dequantize(W), the weight dequantized tile
by tile in registers, never whole in memory. Used on CUDA/ROCm devices; on CPU the torch path runs.

One kernel serves both layouts: GPTQ packs weights along the input dimension (K), AWQ along the output
dimension (N) in its interleaved order; both pack zero points along N. GPTQ names each input row's group
in `g_idx` (act-order), AWQ's groups are consecutive rows. Triton is imported and the kernel compiled on first use, so
`TRITON_INTERPRET=1` set before the first call runs it on CPU tensors (tests).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton.language as tl
except ImportError:  # the CUDA path checks for triton; the kernel below is never compiled
    tl = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32
MAX_TOKENS = 32
"""Above this many tokens one dequantization feeding the vendor matmul amortises better than the fused
kernel, whose gain is reading 4-bit weights once per decode step."""


def triton_runs(weight: torch.Tensor) -> bool:
    """The kernel targets CUDA (and ROCm, which torch also calls cuda) where triton is installed."""
    return weight.device.type == "cuda" and tl is not None


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
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    weights = (t.contiguous() for t in (qweight, qzeros, scales))
    _kernel()[grid](
        rows, *weights, g_idx if g_idx is None else g_idx.contiguous(), out, m, n, k, group_size,
        HAS_G_IDX=g_idx is not None, BITS=bits, ZERO_OFFSET=zero_offset, AWQ=awq, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def _dot_dtype(dtype: torch.dtype):
    """The tile dtype for tl.dot: the activation dtype, except bfloat16 under the interpreter (numpy has
    no bfloat16 matmul)."""
    import triton

    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


@functools.cache
def _kernel():
    import triton

    return triton.jit(_packed_matmul)


def _packed_matmul(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr, M, N, K, group_size,
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
