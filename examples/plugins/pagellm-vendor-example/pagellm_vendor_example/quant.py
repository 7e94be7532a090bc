"""`vendor_int8`: weight-only int8 with one scale per output channel, quantized at load time.

The checkpoint holds ordinary float weights (and, if it asks for this format, `quant_method: vendor_int8` in
its `quantization_config`); the loader fills a float `weight`, which is then replaced by int8 `qweight` and a
float32 `scale`, halving or quartering the weight memory.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.quant import QuantMethod


class VendorInt8Method(QuantMethod):
    name = "vendor_int8"
    # What it needs of a platform, if anything, is declared here, never in a platform's code: plain torch int8
    # needs nothing, so it runs on every platform. A method with its own kernels would say, for example,
    # `device_types = ("cuda",)`, `requires = ("triton",)` (names in pagellm.core.platform.CAPABILITIES, or
    # the vendor's own, which its platform declares in `capabilities`), `dtypes = (torch.float16,)` or
    # `min_capability = (8, 9)`; the selector and `pagellm plugins` then refuse it where one is unmet, saying which.

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        weight = torch.empty(out_features, in_features, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scale = quantize(layer.weight.detach())
        del layer.weight
        layer.register_parameter("qweight", nn.Parameter(qweight, requires_grad=False))
        layer.register_parameter("scale", nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x @ (q * s)^T == (x @ q^T) * s for a per-output-channel s: the scale is applied after the matmul.
        y = torch.nn.functional.linear(x, layer.qweight.to(x.dtype)) * layer.scale.to(x.dtype)
        return y if bias is None else y + bias


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (row): weight ~= qweight * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scale
