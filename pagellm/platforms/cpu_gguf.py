"""Linear layers on GGUF block formats read in place (`cpu_kernels/gguf_linear.cpp`).

A layer keeps each checkpoint tensor's bytes as the file has them (uint8 [out, bytes per row]) and the op,
`pagellm::gguf_linear`, multiplies x with them directly: x quantized to int8 in groups of 32, integer dot
products per weight group (up to four rows straight from the blocks, more in tiles of eight x rows), so the
memory a model takes is its file's size and a decode step reads the file's bytes once. Defined here with a fake implementation and implemented in C++, so under torch.compile
it is one opaque call. A token embedding stored in a block type stays packed the same way
(`pagellm::gguf_embedding` dequantizes the rows a step looks up), and a tied output projection multiplies
with those same bytes.
"""

from __future__ import annotations

import logging

import torch

from pagellm.platforms import cpu_kernels

logger = logging.getLogger("pagellm")

torch.library.define("pagellm::gguf_linear", "(Tensor x, Tensor[] parts, int[] types) -> Tensor")


@torch.library.register_fake("pagellm::gguf_linear")
def _(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(p.shape[0] for p in parts)))


torch.library.define("pagellm::gguf_embedding", "(Tensor ids, Tensor table, int type) -> Tensor")


@torch.library.register_fake("pagellm::gguf_embedding")
def _(ids: torch.Tensor, table: torch.Tensor, type_id: int) -> torch.Tensor:
    block, size = _layout(type_id)
    return table.new_empty((*ids.shape, table.shape[1] // size * block), dtype=torch.float32)


INTERLEAVED = 1000
"""pagellm's own type numbers: INTERLEAVED + a 32-weight block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4,
IQ4_NL) is that type's rows rewritten four blocks at a time (`interleave`), in the kernel's layout (`cpu_kernels/gguf_blocks.h`)."""


def _layout(type_id: int) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(base_type(type_id))]  # an interleaved row: as many bytes


def base_type(type_id: int) -> int:
    """The GGML type whose blocks `type_id` holds: itself, or an interleaved type's."""
    return type_id - INTERLEAVED if type_id > INTERLEAVED else type_id


def type_name(type_id: int) -> str:
    """A GGML type's name, or an interleaved one's as "Q5_0 (interleaved)"."""
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(base_type(type_id)).name
    return f"{name} (interleaved)" if type_id > INTERLEAVED else name


def available() -> bool:
    """True where the native kernels are built (the reason is logged once by `cpu_kernels.load` when not)."""
    return cpu_kernels.load() is not None


KERNEL_TYPES = frozenset((2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 39))
"""The GGML types the kernels multiply in place once built: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M and MXFP4 (`has_kernel`
asks the built library, which also reads pagellm's interleaved types)."""

_kernel_types: dict[int, bool] = {}


def has_kernel(type_id: int) -> bool:
    """Whether GGML type `type_id` is multiplied in place here (`KERNEL_TYPES` and the interleaved types
    where the kernels are built). False while they build in the
    background: the same question is asked again when they are taken up."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return False
    if type_id not in _kernel_types:
        _kernel_types[type_id] = bool(kernels.gguf_kernel_type(type_id))
    return _kernel_types[type_id]


def kernels_pending() -> bool:
    """Whether the kernels are still building in the background (`cpu_kernels.build_in_background`): blocks of
    the `KERNEL_TYPES` are then widened for the time being and kept aside, to be read in place once the
    model runner takes the kernels up."""
    return not cpu_kernels.background_build_done()


def interleave(raw: torch.Tensor, type_id: int) -> tuple[torch.Tensor, int]:
    """uint8 [..., bytes per row] of GGML type `type_id` in the layout the kernel reads fastest, and its type:
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 and IQ4_NL rows rewritten four blocks at a time (the
    same bytes, about half the instructions a weight at one x row); any other tensor, or rows whose blocks
    are not a multiple of four, as they are."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return raw, type_id
    _say_instructions(kernels)
    to = int(kernels.gguf_interleaved_type(type_id))
    if to < 0 or raw.shape[-1] % (4 * _layout(type_id)[1]):
        return raw, type_id
    return kernels.gguf_interleave(raw.contiguous(), type_id), to


_said: list[str] = []


def _say_instructions(kernels) -> None:
    """Log once, as the first weight goes on the kernel (every one passes `interleave`), which instructions
    multiply the blocks here (`gguf_isa`): scalar C++, AVX2, AVX2 with VNNI's byte products, and AMX's int8
    tiles for products of nine x rows or more where the CPU has them; and whether a decode step's next weight
    rows are prefetched by software (Intel) or left to the CPU (AMD, whose prefetchers did better)."""
    if _said:
        return
    isa = str(kernels.gguf_isa())
    _said.append(isa)
    tiles = ", AMX's int8 tiles from nine x rows" if isa.startswith("amx-int8") else ""
    rows = "asked for by software" if kernels.gguf_rows_asked_ahead() else "left to the CPU's prefetchers"
    logger.info(
        "gguf: blocks multiplied in place on the native CPU kernel (%s%s; a decode step's next weight rows %s)",
        isa,
        tiles,
        rows,
    )


def linear(x: torch.Tensor, parts: list[torch.Tensor], types: list[int]) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) @ the parts' weights^T, side by side, in x's dtype."""
    return torch.ops.pagellm.gguf_linear(x, parts, types)


def embedding(ids: torch.Tensor, table: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` of a token embedding kept as GGUF blocks (uint8 [vocab, bytes per row]), in `dtype`."""
    return torch.ops.pagellm.gguf_embedding(ids, table, type_id).to(dtype)


def dequantize(raw: torch.Tensor, type_id: int) -> torch.Tensor:
    """uint8 [rows, bytes per row] of GGML type `type_id` -> float32 [rows, columns], the same bits as
    gguf-py's `gguf.quants.dequantize`."""
    return cpu_kernels.load().gguf_dequantize(raw.contiguous(), type_id)
