"""`fp8`: FP8 E4M3 weights with one float32 scale per output channel (vLLM / compressed-tensors naming).

`--quantization fp8` quantizes an unquantized checkpoint while it loads; a checkpoint with
`quantization_config: {"quant_method": "fp8"}` holds `weight` float8_e4m3fn [out, in] and `weight_scale`
(float32 [out, 1], [out], or a per-tensor scalar as AutoFP8 writes), or, with `weight_block_size`, block
scales `weight_scale_inv`, requantized per row as they load (`fp8_blocks`). Only dynamic activation scaling
is read: static `input_scale` checkpoints are refused.

Compute: on CUDA devices with FP8 tensor cores, activations are quantized to FP8 too and multiplied with
torch._scaled_mm (as vLLM does), laid out as its CUDA kernels require (`scaled_mm_linear`): row-wise
(a scale per token and per output channel) from compute capability 9.0 with bfloat16 activations, or
tensor-wise (one scale each) on 8.9 when the checkpoint's weight scale is per-tensor. On CPU, weight-only
on the native panel kernel (`ChannelwiseMethod`). Everywhere else, and where a one-off probe at load
finds the kernel missing, the weight is dequantized into the activation dtype (weight-only), which any
device that can cast float8 runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.platform import FLOAT8
from pagellm.core.quant import QuantMethod
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization.channelwise import ChannelwiseMethod
from pagellm.quantization.fp8_blocks import block_size, requantized

PAGELLM_PLUGIN_API = "1.3"

logger = logging.getLogger("pagellm")

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ROWWISE, TENSORWISE = "rowwise", "tensorwise"
ROWWISE_CAPABILITY = (9, 0)
"""torch's row-wise FP8 kernel (float32 scales [M, 1] and [1, N]) needs Hopper or later, and writes
bfloat16 only."""
TENSORWISE_CAPABILITY = (8, 9)
"""Ada has FP8 tensor cores, but torch runs only tensor-wise scaling there (cuBLASLt, one float32 scale per
operand; bfloat16, float16 or float32 out)."""
ROWS_MULTIPLE = 16
"""cuBLASLt's FP8 GEMMs refuse a token count M that is not a multiple of 16 (K and N must be too), so
the quantized activations are padded with zero rows up to it and the result sliced back."""
TENSORWISE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8Method(ChannelwiseMethod):
    name = "fp8"
    storage_dtype = FP8
    expert_dtype = FP8
    qmax = FP8_MAX
    requires = (FLOAT8,)  # weights stay float8_e4m3fn on the device; torch._scaled_mm is probed, not needed

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        config = self.quantization_config
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"fp8 checkpoints with activation_scheme {config['activation_scheme']!r} (static input "
                f"scales) are not supported; use one with dynamic activation scaling"
            )
        blocks = config.get("weight_block_size")
        self.block_size = block_size(blocks) if blocks is not None else None
        """(rows, columns) of a block-wise checkpoint's scale blocks; None: scales per row or tensor."""

    @classmethod
    def to_storage(cls, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp(-cls.qmax, cls.qmax).to(FP8)

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, Any]], float_modules: tuple[str, ...] = ()
    ) -> Iterable[tuple[str, Any]]:
        if self.block_size is None:
            return weights
        return requantized(weights, self.block_size, self.quantize, float_modules)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fp8_scaled_mm = _scaled_mm_runs(layer.weight, layer.weight_scale)
        if layer.fp8_scaled_mm is None:
            super().process_weights_after_loading(layer)  # the CPU panel kernel, where it runs

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        scheme = layer.fp8_scaled_mm
        if (scheme == ROWWISE and x.dtype == torch.bfloat16) or (
            scheme == TENSORWISE and x.dtype in TENSORWISE_DTYPES
        ):
            return scaled_mm_linear(x, layer.weight, layer.weight_scale, bias, scheme)
        return super().apply(layer, x, bias)


def scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    scheme: str = ROWWISE,
) -> torch.Tensor:
    """FP8 x FP8 matmul with torch._scaled_mm, its arguments as CUDA's kernels require: x [M, K] quantized
    row-major, M padded to ROWS_MULTIPLE; the weight [N, K] (contiguous) passed as its transpose, which is
    the column-major [K, N] they take; float32 scales, [M, 1] per token and [1, N] per output channel
    (`ROWWISE`), or one each (`TENSORWISE`)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if scheme == ROWWISE:
        x_scale = rows.abs().amax(dim=1, keepdim=True).float()
        w_scale = scale.float().reshape(1, -1)
    else:
        x_scale = rows.abs().amax().float()
        w_scale = scale.float().reshape(-1)[0]
    x_scale = (x_scale / FP8_MAX).clamp(min=1e-12)
    x_fp8 = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    pad = -m % ROWS_MULTIPLE
    if pad:
        x_fp8 = torch.cat([x_fp8, x_fp8.new_zeros(pad, x_fp8.shape[1])])
        if scheme == ROWWISE:
            x_scale = torch.cat([x_scale, x_scale.new_ones(pad, 1)])
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)[:m]
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _scaled_mm_runs(weight: torch.Tensor, scale: torch.Tensor | None = None) -> str | None:
    """The torch._scaled_mm scheme this layer runs on its device (`ROWWISE` or `TENSORWISE`), or None:
    dequantize. `scale` None means per-channel. Both weight dimensions must divide by 16 and the weight
    be contiguous (its transpose is then column-major)."""
    capability = _cuda_capability(weight.device)
    if capability is None or capability < TENSORWISE_CAPABILITY:
        return None
    if weight.shape[0] % 16 or weight.shape[1] % 16 or not weight.is_contiguous():
        return None
    if capability >= ROWWISE_CAPABILITY:
        scheme = ROWWISE
    elif scale is not None and bool((scale == scale.reshape(-1)[0]).all()):
        scheme = TENSORWISE
    else:
        return None
    return scheme if _scheme_works(weight.device, scheme) else None


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.cache
def _scheme_works(device: torch.device, scheme: str) -> bool:
    """One 16 x 16 x 16 product through the scheme, once per device: a torch build without that kernel
    for this architecture fails here, at load, and its layers dequantize instead of failing a step."""
    weight = torch.ones(16, 16, device=device).to(FP8)
    try:
        x = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        scaled_mm_linear(x, weight, torch.ones(16, 1, device=device), None, scheme)
    except RuntimeError as exc:
        logger.warning(
            "fp8: torch._scaled_mm (%s) fails on %s, dequantizing instead: %s", scheme, device, exc
        )
        return False
    return True


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [Fp8Method]
