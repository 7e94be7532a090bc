"""A Triton GEMM over GGUF blocks as the file stores them: y = x @ W^T with W [N, K] in one of llama.cpp's
block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each tile of W dequantized in registers from
its bytes, so the weights stay the file's size in device memory. Used on CUDA/ROCm devices for steps of up to
MAX_TOKENS rows; larger steps dequantize the whole weight once (`gguf.dequantize`) for the vendor matmul.

The kernel reads each weight's bytes where its block keeps them (gathered loads: block start + the type's
offsets for that weight), so one kernel serves every type (TYPE a compile-time constant): the scales' float16
bytes are assembled and bitcast, the K-quants' 6-bit sub-block scales unpacked as gguf-py does. Like
`packed_triton`, it is jitted once per interpreter mode, autotuned over DEVICE_TILES on a device and run on
INTERPRETER_TILE under TRITON_INTERPRET=1 (the tests, on CPU tensors).
"""

from __future__ import annotations

import functools

import torch

from pagellm.core.triton_language import bind_triton_language
from pagellm.quantization.packed_triton import MAX_TOKENS, _dot_dtype, _prune_tiles, tile_configs

tl = None  # triton.language once a kernel is needed (`bind_triton_language`)

TYPES = {
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    20: (32, 18),
    23: (256, 136),
}
"""GGML type number -> (weights per block, bytes per block) of the types the kernel reads."""

__all__ = ["MAX_TOKENS", "TYPES", "gguf_matmul", "runs"]


def runs(type_id: int, device: torch.device) -> bool:
    """Whether the kernel multiplies this type on this device: CUDA (and ROCm, which torch also calls cuda)
    where triton is installed."""
    return device.type == "cuda" and type_id in TYPES and bind_triton_language(globals()) is not None


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, type_id: int) -> torch.Tensor:
    """x [..., K] @ W^T, W the uint8 [N, K / block size * block bytes] blocks of GGML type `type_id`."""
    import triton

    bind_triton_language(globals())
    block_size, block_bytes = TYPES[type_id]
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = raw.shape[0]
    if raw.shape[1] != k // block_size * block_bytes or k % block_size:
        raise ValueError(f"{tuple(raw.shape)} bytes of GGML type {type_id} do not hold a [{n}, {k}] weight")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dot_dtype = _dot_dtype(x.dtype)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    _kernel()[grid](
        rows, raw.contiguous(), out, m, n, k, raw.shape[1], triton.next_power_of_2(m),
        TYPE=type_id, BLOCK_SIZE=block_size, BLOCK_BYTES=block_bytes, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def _kernel():
    """The kernel for the current interpreter mode (see `packed_triton._kernel`)."""
    import triton

    return _kernel_in_mode(bool(triton.knobs.runtime.interpret))


@functools.cache
def _kernel_in_mode(interpreting: bool):
    import triton

    bind_triton_language(globals())
    return triton.autotune(
        configs=tile_configs(interpreting),
        key=["M_BUCKET", "N", "K", "TYPE"],
        prune_configs_by={"early_config_prune": _prune_tiles},
    )(triton.jit(_gguf_matmul))


def _gguf_matmul(
    x_ptr, w_ptr, out_ptr, M, N, K, ROW_BYTES, M_BUCKET, TYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # not tl.zeros (see packed_triton)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        tile_mask = mask_k[:, None] & mask_n[None, :]
        # [BLOCK_K, BLOCK_N]: where each weight's block starts, and the weight's place in it
        row = w_ptr + offs_n[None, :].to(tl.int64) * ROW_BYTES + (offs_k // BLOCK_SIZE * BLOCK_BYTES)[:, None]
        e = (offs_k % BLOCK_SIZE)[:, None]
        # Each weight computed in gguf-py's order from its block's bytes (loaded as int32; a float16 is two
        # bytes assembled and bitcast). No helper functions: a jitted helper is jitted in one interpreter
        # mode, and the kernel is made in both.
        if TYPE == 14:  # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
            within = e % 128
            low = tl.load(row + (e // 128 * 64 + within % 64), mask=tile_mask, other=0).to(tl.int32)
            high = tl.load(row + (128 + e // 128 * 32 + e % 32), mask=tile_mask, other=0).to(tl.int32)
            q = ((low >> (within // 64 * 4)) & 0xF) | (((high >> (within // 32 * 2)) & 3) << 4)
            s = tl.load(row + (192 + e // 16), mask=tile_mask, other=0).to(tl.int32)
            d_lo = tl.load(row + 208, mask=tile_mask, other=0).to(tl.int32)
            d_hi = tl.load(row + 209, mask=tile_mask, other=0).to(tl.int32)
            d = (d_lo | (d_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            w = (d * (s - ((s >> 7) << 8)).to(tl.float32)) * (q - 32).to(tl.float32)
        elif TYPE == 10 or TYPE == 11:  # Q2_K: 16 scale bytes, 64 of 2-bit codes, d, dmin; Q3_K: 32 bytes of
            # third bits (bit e // 32 of byte e % 32, clear meaning minus 4), 64 of 2-bit codes, 12 of 6-bit
            # scales less 32, d. Weight e's two bits: byte e // 128 * 32 + e % 32 of the codes, bits 2 (e % 128 // 32)
            CODES: tl.constexpr = 16 if TYPE == 10 else 32
            D_AT: tl.constexpr = 80 if TYPE == 10 else 108
            code = tl.load(row + (CODES + e // 128 * 32 + e % 32), mask=tile_mask, other=0).to(tl.int32)
            q = (code >> (e % 128 // 32 * 2)) & 3
            d_lo = tl.load(row + D_AT, mask=tile_mask, other=0).to(tl.int32)
            d_hi = tl.load(row + (D_AT + 1), mask=tile_mask, other=0).to(tl.int32)
            d = (d_lo | (d_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            j = e // 16
            if TYPE == 10:
                sc = tl.load(row + j, mask=tile_mask, other=0).to(tl.int32)
                m_lo = tl.load(row + 82, mask=tile_mask, other=0).to(tl.int32)
                m_hi = tl.load(row + 83, mask=tile_mask, other=0).to(tl.int32)
                m = (m_lo | (m_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                w = (d * (sc & 0xF).to(tl.float32)) * q.to(tl.float32) - m * (sc >> 4).to(tl.float32)
            else:
                low = tl.load(row + (96 + j % 8), mask=tile_mask, other=0).to(tl.int32)
                high = tl.load(row + (104 + j % 4), mask=tile_mask, other=0).to(tl.int32)
                sc = (((low >> (j // 8 * 4)) & 0xF) | (((high >> (j // 4 * 2)) & 3) << 4)) - 32
                third = tl.load(row + e % 32, mask=tile_mask, other=0).to(tl.int32)
                q = q - (((third >> (e // 32)) & 1) ^ 1) * 4
                w = (d * sc.to(tl.float32)) * q.to(tl.float32)
        else:
            d_lo = tl.load(row, mask=tile_mask, other=0).to(tl.int32)
            d_hi = tl.load(row + 1, mask=tile_mask, other=0).to(tl.int32)
            d = (d_lo | (d_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            if TYPE == 3 or TYPE == 7 or TYPE == 12 or TYPE == 13:  # a second float16: m, or dmin
                m_lo = tl.load(row + 2, mask=tile_mask, other=0).to(tl.int32)
                m_hi = tl.load(row + 3, mask=tile_mask, other=0).to(tl.int32)
                m = (m_lo | (m_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            if TYPE == 8:  # Q8_0: d, 32 int8
                q = tl.load(row + (2 + e), mask=tile_mask, other=0).to(tl.int32)
                w = d * (q - ((q >> 7) << 8)).to(tl.float32)
            elif TYPE == 20 or TYPE == 23:  # IQ4_NL: d, 16 bytes of nibbles; IQ4_XS: d, the scales' high bit
                # pairs (16 bits), their low nibbles (4 bytes), 128 bytes of nibbles, 16 per 32 weights
                CODES: tl.constexpr = 2 if TYPE == 20 else 8
                code = tl.load(row + (CODES + e // 32 * 16 + e % 16), mask=tile_mask, other=0).to(tl.int32)
                n = (code >> (e % 32 // 16 * 4)) & 0xF
                # the grid value of nibble n (llama.cpp's kvalues_iq4nl), as a tree of selects
                v = tl.where(
                    n < 8,
                    tl.where(
                        n < 4,
                        tl.where(n < 2, tl.where(n == 0, -127, -104), tl.where(n == 2, -83, -65)),
                        tl.where(n < 6, tl.where(n == 4, -49, -35), tl.where(n == 6, -22, -10)),
                    ),
                    tl.where(
                        n < 12,
                        tl.where(n < 10, tl.where(n == 8, 1, 13), tl.where(n == 10, 25, 38)),
                        tl.where(n < 14, tl.where(n == 12, 53, 69), tl.where(n == 14, 89, 113)),
                    ),
                ).to(tl.float32)
                if TYPE == 20:
                    w = d * v
                else:
                    g = e // 32
                    low = tl.load(row + (4 + g // 2), mask=tile_mask, other=0).to(tl.int32)
                    h_lo = tl.load(row + 2, mask=tile_mask, other=0).to(tl.int32)
                    h_hi = tl.load(row + 3, mask=tile_mask, other=0).to(tl.int32)
                    sc = (((low >> (g % 2 * 4)) & 0xF) | ((((h_lo | (h_hi << 8)) >> (g * 2)) & 3) << 4)) - 32
                    w = (d * sc.to(tl.float32)) * v
            elif TYPE == 12 or TYPE == 13:  # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, codes
                j = e // 32  # the sub-block; its scale and min unpacked as gguf-py's get_scale_min
                first = tl.load(row + (4 + j % 4), mask=tile_mask, other=0).to(tl.int32)
                second = tl.load(row + (8 + j % 4), mask=tile_mask, other=0).to(tl.int32)
                packed = tl.load(row + (12 + j % 4), mask=tile_mask, other=0).to(tl.int32)
                scale = tl.where(j < 4, first & 0x3F, (packed & 0xF) | ((first >> 6) << 4))
                minimum = tl.where(j < 4, second & 0x3F, (packed >> 4) | ((second >> 6) << 4))
                CODES: tl.constexpr = 16 if TYPE == 12 else 48
                code = tl.load(row + (CODES + e // 64 * 32 + e % 32), mask=tile_mask, other=0).to(tl.int32)
                q = (code >> (j % 2 * 4)) & 0xF
                if TYPE == 13:
                    fifth = tl.load(row + (16 + e % 32), mask=tile_mask, other=0).to(tl.int32)
                    q = q | (((fifth >> j) & 1) << 4)
                w = (d * scale.to(tl.float32)) * q.to(tl.float32) - m * minimum.to(tl.float32)
            else:  # Q4_0, Q4_1, Q5_0, Q5_1: d (and m), (the fifth bits as a uint32,) 16 bytes of nibbles
                CODES: tl.constexpr = 2 if TYPE == 2 else (4 if TYPE == 3 else (6 if TYPE == 6 else 8))
                code = tl.load(row + (CODES + e % 16), mask=tile_mask, other=0).to(tl.int32)
                q = (code >> (e // 16 * 4)) & 0xF
                if TYPE == 6 or TYPE == 7:
                    FIFTH: tl.constexpr = 2 if TYPE == 6 else 4
                    bits = tl.load(row + (FIFTH + e // 8), mask=tile_mask, other=0).to(tl.int32)
                    q = q | (((bits >> (e % 8)) & 1) << 4)
                if TYPE == 2:
                    w = d * (q - 8).to(tl.float32)
                elif TYPE == 6:
                    w = d * (q - 16).to(tl.float32)
                else:
                    w = d * q.to(tl.float32) + m
        w = tl.where(tile_mask, w, 0.0)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
