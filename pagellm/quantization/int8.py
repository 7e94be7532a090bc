"""`int8`: weight-only int8, one float32 scale per output channel.

`--quantization int8` quantizes an unquantized checkpoint while it loads; a checkpoint saved this way
(`weight` int8 [out, in], `weight_scale` float32 [out, 1], `quantization_config: {"quant_method": "int8"}`)
is loaded as is. Compute dequantizes into the activation dtype and runs the ordinary matmul, on any device:
int8 x int8 kernels (torch._int_mm) would also need the activations quantized, which this format does not do.
"""

from __future__ import annotations

import torch

from pagellm.core.quant import QuantMethod
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization.channelwise import ChannelwiseMethod

PAGELLM_PLUGIN_API = "1.0"


class Int8Method(ChannelwiseMethod):
    name = "int8"
    storage_dtype = torch.int8
    qmax = 127.0

    @classmethod
    def to_storage(cls, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-cls.qmax, cls.qmax).to(torch.int8)


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [Int8Method]
