"""Linear layers on GGUF block formats read in place (`cpu_kernels/gguf_linear.cpp`).

A layer keeps each checkpoint tensor's bytes as the file has them (uint8 [out, bytes per row]) and the op,
`pagellm::gguf_linear`, multiplies x with them directly: x quantized to int8 in groups of 32, integer dot
products per weight group, so the memory a model takes is its file's size and a decode step reads the
file's bytes once. Defined here with a fake implementation and implemented in C++, so under torch.compile
it is one opaque call.
"""

from __future__ import annotations

import functools

import torch

from pagellm.platforms import cpu_kernels

torch.library.define("pagellm::gguf_linear", "(Tensor x, Tensor[] parts, int[] types) -> Tensor")


@torch.library.register_fake("pagellm::gguf_linear")
def _(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(p.shape[0] for p in parts)))


def available() -> bool:
    """True where the native kernels are built (the reason is logged once by `cpu_kernels.load` when not)."""
    return cpu_kernels.load() is not None


@functools.cache
def has_kernel(type_id: int) -> bool:
    """Whether GGML type `type_id` is multiplied in place here (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    Q6_K where the kernels are built)."""
    kernels = cpu_kernels.load()
    return kernels is not None and bool(kernels.gguf_kernel_type(type_id))


def linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) @ the parts' weights^T, side by side, in x's dtype."""
    return torch.ops.pagellm.gguf_linear(x, parts, types)


def dequantize(raw: torch.Tensor, type_id: int) -> torch.Tensor:
    """uint8 [rows, bytes per row] of GGML type `type_id` -> float32 [rows, columns], the same bits as
    gguf-py's `gguf.quants.dequantize`."""
    return cpu_kernels.load().gguf_dequantize(raw.contiguous(), type_id)
