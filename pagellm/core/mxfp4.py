"""MXFP4 (OCP microscaling, 4-bit floats): how GPT-OSS checkpoints store their experts.

A weight row of K values is cut into K/32 blocks. Each block keeps 32 FP4 (E2M1) codes, two per byte, the
even element in the low nibble (`blocks`: uint8 [..., K/32, 16]), and one shared power of two, an E8M0
exponent biased by 127 (`scales`: uint8 [..., K/32]). The value of code c in a block with scale s is
FP4_VALUES[c] * 2^(s - 127), which every float dtype from bfloat16 up holds exactly, so dequantizing is
lossless (transformers' `convert_moe_packed_tensors` computes the same values).
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
"""Values that share one scale."""

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code -> value: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa."""

SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> values [..., G * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: blocks "
            f"must be [..., G, {BLOCK_SIZE // 2}] and scales [..., G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)  # low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


GGML_BLOCK_BYTES = 1 + BLOCK_SIZE // 2
"""Bytes of one block in GGML's MXFP4 layout (`ggml_rows`): the scale byte, then the 16 code bytes."""


def ggml_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> uint8 [..., G * 17], the same bytes as GGML's
    MXFP4 blocks (GGML type 39, what llama.cpp's GGUF files hold and the CPU kernels read): each block's
    scale byte first, then its codes with element l in byte l's low nibble and l + 16 in its high one,
    where the checkpoint pairs elements 2l and 2l + 1 in byte l. The values are the same, bit for bit."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: blocks "
            f"must be [..., G, {BLOCK_SIZE // 2}] and scales [..., G]"
        )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # element order
    half = BLOCK_SIZE // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2).contiguous()
