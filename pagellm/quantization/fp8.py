"""`fp8`: FP8 E4M3 weights with one float32 scale per output channel (vLLM / compressed-tensors naming).

`--quantization fp8` quantizes an unquantized checkpoint while it loads; a checkpoint with
`quantization_config: {"quant_method": "fp8"}` holds `weight` float8_e4m3fn [out, in] and `weight_scale`
(float32 [out, 1], [out], or a per-tensor scalar as AutoFP8 writes). Only dynamic activation scaling is
read: static `input_scale` and block-wise `weight_block_size` checkpoints are refused.

Compute: on CUDA devices of capability >= 8.9 with bfloat16 activations, activations are quantized per
token to FP8 and multiplied with torch._scaled_mm (as vLLM does); everywhere else the weight is
dequantized into the activation dtype (weight-only), which any device that can cast float8 runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.quant import QuantMethod
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization.channelwise import ChannelwiseMethod, dequantized_linear

PAGELLM_PLUGIN_API = "1.0"

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALED_MM_CAPABILITY = (8, 9)
"""Ada / Hopper and later have FP8 tensor cores."""


class Fp8Method(ChannelwiseMethod):
    name = "fp8"
    storage_dtype = FP8
    qmax = FP8_MAX

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        config = self.quantization_config
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"fp8 checkpoints with activation_scheme {config['activation_scheme']!r} (static input "
                f"scales) are not supported; use one with dynamic activation scaling"
            )
        if config.get("weight_block_size"):
            raise ConfigError(
                f"block-wise fp8 (weight_block_size {config['weight_block_size']}) is not supported; "
                f"use a per-tensor or per-channel fp8 checkpoint"
            )

    @classmethod
    def to_storage(cls, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp(-cls.qmax, cls.qmax).to(FP8)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fp8_scaled_mm = _scaled_mm_runs(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.fp8_scaled_mm and x.dtype == torch.bfloat16:
            return scaled_mm_linear(x, layer.weight, layer.weight_scale, bias)
        return dequantized_linear(x, layer.weight, layer.weight_scale, bias)


def scaled_mm_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """FP8 x FP8 matmul: x quantized per token (row-wise scale), weight per output channel."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x_fp8 = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _scaled_mm_runs(weight: torch.Tensor) -> bool:
    """torch._scaled_mm needs FP8 tensor cores and both weight dimensions divisible by 16."""
    if weight.device.type != "cuda" or weight.shape[0] % 16 or weight.shape[1] % 16:
        return False
    return torch.cuda.get_device_capability(weight.device) >= SCALED_MM_CAPABILITY


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [Fp8Method]
