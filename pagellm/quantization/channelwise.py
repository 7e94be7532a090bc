"""Weight-only quantization with one scale per output channel: the shared half of `int8` and `fp8`.

On disk (and in memory) a layer holds `weight` [out, in] in the storage dtype and `weight_scale` float32
[out, 1], with weight ~= weight * weight_scale. A checkpoint that says so in `quantization_config` is copied
as is (a scalar per-tensor `weight_scale`, as AutoFP8 writes, is spread over its rows); an unquantized
checkpoint is quantized tensor by tensor while it loads, so the float weights never sit in memory whole.
A layer a quantized checkpoint holds in float (one its tools left out: `modules_to_not_convert`,
`ignored_layers`) stays a plain float layer.

Compute, unless a subclass takes a faster path first: on CPU the weight moves into the native panel
kernel's layout (`platforms.cpu.pack_weight_only`: one byte per weight, widened in registers, its scale
applied to the sums), else it is dequantized into the activation dtype for `F.linear` on every call.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.quant import QuantMethod
from pagellm.platforms import cpu

UNQUANTIZED = (torch.float32, torch.bfloat16, torch.float16)
"""Weight dtypes of a layer a quantized checkpoint left unquantized."""


class ChannelwiseMethod(QuantMethod):
    storage_dtype: ClassVar[torch.dtype]
    qmax: ClassVar[float]
    """Largest magnitude the storage dtype holds; a row's absolute maximum maps onto it."""

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        found = self.quantization_config.get("quant_method")
        if found is not None and found != self.name:
            raise ConfigError(
                f"the checkpoint is quantized as {found!r}; --quantization {self.name} needs an unquantized "
                f"checkpoint or one saved as {self.name!r} (leave --quantization unset to use {found!r})"
            )
        self.serialized = found == self.name
        """True: the checkpoint holds quantized weights and scales; False: quantize while loading."""

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-row quantization of [..., out, in]: (weight in storage dtype, float32 scale
        [..., out, 1])."""
        w = weight.float()
        scale = (w.abs().amax(dim=-1, keepdim=True) / cls.qmax).clamp(min=torch.finfo(torch.float32).tiny)
        return cls.to_storage(w / scale), scale

    @classmethod
    def quantize_rows(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qweight, scale = cls.quantize(weight)
        return qweight, scale.squeeze(-1)

    @classmethod
    def to_storage(cls, scaled: torch.Tensor) -> torch.Tensor:
        """Round float values already in [-qmax, qmax] (up to rounding) to the storage dtype."""
        raise NotImplementedError

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=self.storage_dtype), requires_grad=False
        )
        weight.weight_loader = partial(self._load_weight, layer, params_dtype)
        layer.register_parameter("weight", weight)
        layer.activation_dtype = params_dtype
        layer.loaded_quantized = False
        """Whether a quantized checkpoint part reached the weight (a fused layer must not mix them)."""
        scale = torch.empty(out_features, 1, dtype=torch.float32)
        if self.serialized:
            # A parameter, so a checkpoint missing it fails at load; quantizing at load time fills a buffer.
            scale = nn.Parameter(scale, requires_grad=False)
            scale.weight_loader = partial(self._load_scale, layer)
            layer.register_parameter("weight_scale", scale)
        else:
            layer.register_buffer("weight_scale", scale)

    def _load_weight(
        self,
        layer: nn.Module,
        params_dtype: torch.dtype,
        param: nn.Parameter,
        tensor: torch.Tensor,
        shard: int | None,
    ):
        if self.serialized and tensor.dtype in UNQUANTIZED:
            _keep_unquantized(layer, params_dtype, tensor, shard)
            return
        if self.serialized:
            if tensor.dtype != self.storage_dtype:
                raise ConfigError(
                    f"the checkpoint says {self.name} but holds a {tensor.dtype} weight of shape "
                    f"{tuple(tensor.shape)}; re-save it with {self.storage_dtype} weights"
                )
            layer.loaded_quantized = True
            _copy_rows(layer, param, tensor, shard)
            return
        qweight, scale = self.quantize(tensor)
        _copy_rows(layer, param, qweight, shard)
        _copy_rows(layer, layer.weight_scale, scale, shard)

    def _load_scale(self, layer: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard: int | None):
        rows = layer.out_features if shard is None else layer.output_sizes[shard]
        scale = tensor.float().reshape(-1, 1)
        if scale.shape[0] == 1:
            scale = scale.expand(rows, 1)
        _copy_rows(layer, param, scale, shard)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The panel kernel's layout where it runs: the panels and their padded scales replace the weight and
        its scale."""
        activation_dtype = getattr(layer, "activation_dtype", None)  # None: not built by create_weights
        if activation_dtype is None:
            return
        packed = cpu.pack_weight_only(layer.weight.data, layer.weight_scale.data, activation_dtype)
        if packed is not None:
            layer.register_buffer("panel_weight", packed[0], persistent=False)
            layer.register_buffer("panel_scale", packed[1], persistent=False)
            layer.weight = layer.weight_scale = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer, "panel_weight", None) is not None:
            return cpu.weight_only_linear(x, layer.panel_weight, layer.panel_scale, bias, layer.out_features)
        return dequantized_linear(x, layer.weight, layer.weight_scale, bias)


def dequantized_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (weight * scale)^T + bias in x's dtype; a per-row scale commutes with the matmul, so it is
    applied to the [tokens, out] result instead of the [out, in] weight."""
    y = F.linear(x, weight.to(x.dtype)) * scale.view(-1).to(x.dtype)
    return y if bias is None else y + bias


def _keep_unquantized(layer: nn.Module, dtype: torch.dtype, tensor: torch.Tensor, shard: int | None) -> None:
    """Make `layer` a plain float layer (no quant method, a `dtype` weight, no scale) and copy `tensor` in.
    Its other fused parts must be float too: the new weight's loader refuses quantized ones, and quantized
    parts already copied refuse the change."""
    if layer.loaded_quantized:
        raise ConfigError(
            f"a fused layer of output sizes {layer.output_sizes} mixes quantized checkpoint parts and an "
            f"unquantized {tensor.dtype} one; quantize all of its parts or none"
        )
    weight = nn.Parameter(
        torch.empty(layer.out_features, layer.in_features, dtype=dtype, device=layer.weight.device),
        requires_grad=False,
    )
    weight.weight_loader = partial(_load_float, layer)
    layer.weight = weight
    del layer.weight_scale
    layer.quant_method = None
    _load_float(layer, weight, tensor, shard)


def _load_float(layer: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
    if tensor.dtype not in UNQUANTIZED:
        raise ConfigError(
            f"a fused layer of output sizes {layer.output_sizes} mixes unquantized checkpoint parts and a "
            f"{tensor.dtype} one; quantize all of its parts or none"
        )
    _copy_rows(layer, param, tensor.to(param.dtype), shard)


def _copy_rows(layer: nn.Module, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
    if shard is not None:
        layer.load_shard(param, tensor, shard)
    elif param.shape != tensor.shape:
        raise ConfigError(
            f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}; "
            f"the config does not match the weights"
        )
    else:
        param.data.copy_(tensor)
