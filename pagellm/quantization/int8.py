"""`int8`: weight-only int8, one float32 scale per output channel.

`--quantization int8` quantizes an unquantized checkpoint while it loads; a checkpoint saved this way
(`weight` int8 [out, in], `weight_scale` float32 [out, 1], `quantization_config: {"quant_method": "int8"}`)
is loaded as is.

Compute: on a CPU with AMX, in bfloat16, W8A8: each token's activations are quantized to int8 on the fly
(one scale per token, max |x| / 127) and multiplied with the int8 weights in exact int32 sums
(`platforms.cpu.w8a8_linear`); at decode batch sizes that is 1.5-2.7x oneDNN's bf16 GEMM, because half the
weight bytes move. Other CPUs (and float32) run it weight-only on the native panel kernel
(`ChannelwiseMethod`); other devices dequantize the weights into the activation dtype for the ordinary
matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.quant import QuantMethod
from pagellm.platforms import cpu
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization.channelwise import ChannelwiseMethod

PAGELLM_PLUGIN_API = "1.0"


class Int8Method(ChannelwiseMethod):
    name = "int8"
    # requires nothing: int8 weights cast for an ordinary matmul; W8A8 on AMX is a fast path taken at load
    storage_dtype = torch.int8
    expert_dtype = torch.int8
    qmax = 127.0

    @classmethod
    def to_storage(cls, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-cls.qmax, cls.qmax).to(torch.int8)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """W8A8 where it runs: the weight moves into the AMX tile layout (same bytes), the plain copy goes;
        elsewhere the shared weight-only path (`ChannelwiseMethod`)."""
        weight = layer.weight
        if (
            weight.device.type != "cpu"
            or layer.activation_dtype != torch.bfloat16
            or not cpu.w8a8_available()
        ):
            super().process_weights_after_loading(layer)
            return
        layer.register_buffer("w8a8_weight", cpu.pack_w8a8(weight.data), persistent=False)
        layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer, "w8a8_weight", None) is not None:
            scale = layer.weight_scale.view(-1)  # float32 [out, 1], contiguous
            return cpu.w8a8_linear(x, layer.w8a8_weight, scale, bias, layer.out_features)
        return super().apply(layer, x, bias)


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [Int8Method]
