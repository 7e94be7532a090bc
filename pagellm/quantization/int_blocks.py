"""AWQ and GPTQ integer weights as llama.cpp blocks, so the CPU's GGUF kernel multiplies them in place.

Both formats store codes q with a scale s and a zero point z per (output row, input group):
w = (q - z) s. A group of 32 inputs that shares one (s, z) is one GGUF block:
- 4-bit, every zero 8 (symmetric checkpoints): Q4_0, d = s, w = (q - 8) d: the same values exactly;
- 4-bit otherwise: Q4_1, d = s and m = -z s, w = d q + m, where m is rounded to float16 (its error is at
  most 2^-11 of z s, a 1/2048 part of one quantization step per unit of z);
- 8-bit, every zero 128: Q8_0, d = s, the code q - 128: exact.
The blocks take 4.5 (Q4_0), 5 (Q4_1) or 8.5 (Q8_0) bits a weight against the checkpoint's ~4.2 or ~8.2
(its scales and zeros at group 128). GPTQ's act-order (`g_idx` not sorted) becomes a permutation of the
inputs: the weight's columns are stored sorted by group, and x is gathered into that order before the
matmul. What fits none of this (8-bit with zero points, groups not a multiple of 32 or not contiguous once
sorted) stays in the checkpoint's layout and is dequantized per matmul; `to_blocks` says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.platforms import cpu_gguf

logger = logging.getLogger("pagellm")

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type numbers
GROUP = 32
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CpuBlocks:
    """A layer's weight as GGUF blocks: uint8 [out, bytes per row] of GGML type `type_id`, and the input
    order its columns are stored in (None: the layer's own)."""

    raw: torch.Tensor
    type_id: int
    perm: torch.Tensor | None


def to_blocks(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> CpuBlocks | str:
    """q [out, in] codes, zeros [groups, out] (the zero points themselves), scales float16 [groups, out],
    g_idx [in] (each input's group) -> the blocks, or why they cannot be made."""
    out_features, in_features = q.shape
    if in_features % GROUP:
        return f"{in_features} inputs are not whole blocks of {GROUP}"
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: store the inputs sorted by group
        perm = torch.argsort(g_idx, stable=True)
        g_idx, q = g_idx[perm], q[:, perm]
    block_groups = g_idx.view(-1, GROUP)
    if not bool((block_groups == block_groups[:, :1]).all()):
        return f"groups of inputs are not whole blocks of {GROUP}"
    group = block_groups[:, 0].long()
    d = scales[group].t().contiguous()  # [out, blocks] float16
    z = zeros[group].t().to(torch.int32)
    codes = q.to(torch.int32).view(out_features, -1, GROUP)
    header = [d]
    if bits == 8:
        if not bool((z == 128).all()):
            return "8-bit weights with zero points other than 128 have no block format"
        type_id, body = Q8_0, (codes - 128).to(torch.int8).view(torch.uint8)
    elif bits == 4:
        symmetric = bool((z == 8).all())
        type_id = Q4_0 if symmetric else Q4_1
        if not symmetric:
            header.append((-(z.float() * d.float())).half())
        body = (codes[..., :16] | codes[..., 16:] << 4).to(torch.uint8)
    else:
        return f"{bits}-bit weights have no block format"
    parts = [h.unsqueeze(-1).view(torch.uint8) for h in header] + [body]
    raw = torch.cat(parts, dim=-1).reshape(out_features, -1).contiguous()
    return CpuBlocks(raw, type_id, None if perm is None else perm.to(torch.int64))


_said: set[tuple[str, str]] = set()


def runs_here(device: torch.device) -> bool:
    """Whether a layer on `device` can be multiplied by the CPU's GGUF kernel."""
    return device.type == "cpu" and cpu_gguf.available()


def install_or_say(
    layer: nn.Module, blocks: CpuBlocks | str, method: str, checkpoint_tensors: tuple[str, ...]
) -> None:
    """Keep only the blocks on `layer` (buffers `cpu_blocks`, `cpu_perm`, its checkpoint tensors dropped);
    where `to_blocks` gave a reason instead, log it once per method and reason and keep the layer as it is."""
    if isinstance(blocks, str):
        if (method, blocks) not in _said:
            _said.add((method, blocks))
            logger.info("%s: %s; those layers are dequantized for each matmul on CPU", method, blocks)
        return
    for name in checkpoint_tensors:
        delattr(layer, name)
    raw, type_id = cpu_gguf.interleave(blocks.raw, blocks.type_id)
    layer.register_buffer("cpu_blocks", raw)
    layer.register_buffer("cpu_perm", blocks.perm)
    layer.cpu_block_type = type_id


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W^T from the layer's blocks, in x's dtype (float16 x goes through float32)."""
    if layer.cpu_perm is not None:
        x = x.index_select(-1, layer.cpu_perm)
    if x.dtype in KERNEL_DTYPES:
        return cpu_gguf.linear(x, [layer.cpu_blocks], [layer.cpu_block_type])
    return cpu_gguf.linear(x.float(), [layer.cpu_blocks], [layer.cpu_block_type]).to(x.dtype)
