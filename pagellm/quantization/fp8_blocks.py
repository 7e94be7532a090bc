"""Block-wise fp8 checkpoints, read as the per-row fp8 the `fp8` method runs.

DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-FP8 and MiniMax-M2 ship `quantization_config: {"quant_method": "fp8",
"weight_block_size": [bm, bn], "activation_scheme": "dynamic"}`, and for each quantized linear and expert
`weight` float8_e4m3fn [out, in] with `weight_scale_inv` float32 [ceil(out / bm), ceil(in / bn)]: the
multiplier of each bm x bn block (w = q * scale_inv), the last row and column of blocks partial where a
dimension does not divide by the block.

`requantized` translates the checkpoint's tensor stream, before any layer (or tensor-parallel rank) takes its
part: each (weight, weight_scale_inv) pair is dequantized in float32 and quantized again with one scale per
output row, into the `weight` + `weight_scale` [out, 1] pair the dense fp8 layers and the quantized experts
already read. That second rounding is the price of running the existing kernels unchanged (the CPU MoE
kernel's e4m3 panels and torch._scaled_mm's row-wise form take one scale per row, not one per 128 columns):
it adds about as much error again as the blocks made (relative RMS weight error 2.6% in 128 x 128 blocks,
3.7% requantized, for normal and heavy-tailed weights alike). Weights the model then drops (DeepSeek-V3's
multi-token-prediction layer) are requantized too. The modules a model reads as plain float weights
(`CausalLM.float_modules`: DeepSeek's kv_b_proj) get the dequantized float32 weight instead, with no second
rounding. Tensors the checkpoint holds unquantized (its modules_to_not_convert / ignored_layers, which have
no weight_scale_inv) pass through unchanged, and their layers stay unquantized (`ChannelwiseMethod`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pagellm.core.errors import ConfigError

FP8 = torch.float8_e4m3fn
WEIGHT, SCALE_INV = "weight", "weight_scale_inv"

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Per-row quantization: float weight [..., out, in] -> (e4m3 values, float32 scales [..., out, 1])."""


def block_size(value: Any) -> tuple[int, int]:
    """`weight_block_size` as (rows, columns), refused unless it is two positive integers."""
    if not (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ConfigError(f"fp8 weight_block_size {value!r} is not two positive integers, e.g. [128, 128]")
    return value[0], value[1]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 q * scale_inv of each block of `weight` [..., out, in], partial edge blocks included."""
    rows, cols = weight.shape[-2:]
    grid = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid or not scale_inv.dtype.is_floating_point:
        raise ConfigError(
            f"a weight of shape {tuple(weight.shape)} in blocks of {list(block)} needs a float "
            f"weight_scale_inv of shape {grid}, the checkpoint has {scale_inv.dtype} {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block[1], -1)[..., :cols]


def requantized(
    weights: Iterable[tuple[str, Any]],
    block: tuple[int, int],
    quantize: Quantize,
    float_modules: tuple[str, ...] = (),
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) stream with each `<module>.weight` e4m3 + `<module>.weight_scale_inv`
    pair replaced by `<module>.weight` e4m3 + `<module>.weight_scale` [out, 1] (`quantize` of the dequantized
    blocks), or by the float32 `<module>.weight` alone for a module named in `float_modules` (its last name
    part). The two halves of a pair may come in either order, apart; the first waits for the second. Lazily
    read weights (`CheckpointSlice`) are read whole, to see their dtype; other tensors pass through."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if kind not in (WEIGHT, SCALE_INV):
            yield name, tensor
            continue
        tensor = tensor if isinstance(tensor, torch.Tensor) else tensor.load()
        if kind == WEIGHT and tensor.dtype != FP8:
            yield name, tensor
            continue
        pair = waiting.setdefault(module, {})
        pair[kind] = tensor
        if len(pair) < 2:
            continue
        del waiting[module]
        weight = dequantize_blocks(pair[WEIGHT], pair[SCALE_INV], block)
        if module.rpartition(".")[2] in float_modules:
            yield f"{module}.weight", weight
            continue
        values, scale = quantize(weight)
        yield f"{module}.weight", values
        yield f"{module}.weight_scale", scale
    if waiting:
        module, pair = next(iter(waiting.items()))
        has, lacks = (WEIGHT, SCALE_INV) if WEIGHT in pair else (SCALE_INV, WEIGHT)
        lacking = f"e4m3 {lacks}" if lacks == WEIGHT else lacks
        raise ConfigError(
            f"block-wise fp8 checkpoint: {module}.{has} has no {lacking} ({len(waiting)} such module(s)); "
            f"each quantized weight needs its block scales (per-tensor or per-channel `weight_scale` "
            f"checkpoints say no weight_block_size)"
        )
