"""`gguf`: llama.cpp's block formats kept quantized in memory and dequantized for each matmul.

The GGUF loader hands each linear weight over as two tensors: `<layer>.qweight`, the tensor's bytes as
uint8 [rows, bytes per row] in Hugging Face row order, and `<layer>.qweight_type`, its GGML type number.
A fused layer (q/k/v, gate/up) keeps one buffer per checkpoint tensor, since llama.cpp may give each a
different type. Compute dequantizes each part into the activation dtype (vectorised torch, any device)
and multiplies; Q4_0, Q4_1, Q8_0 and the float types F32, F16, BF16 are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.platform import DTYPE_VIEWS
from pagellm.core.quant import QuantMethod
from pagellm.plugins.hookspecs import hookimpl

PAGELLM_PLUGIN_API = "1.3"


def _scales(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [rows, blocks, 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles are elements 0-15, the high nibbles 16-31."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[..., 2:]) - 8) * _scales(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[..., 4:]) * _scales(blocks, 0) + _scales(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _scales(blocks, 0)


def _float(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda blocks: blocks.contiguous().view(dtype)


@dataclass(frozen=True)
class GgmlType:
    name: str
    block_size: int
    """Weights per block."""
    block_bytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    """uint8 [rows, blocks, block_bytes] -> [rows, blocks, block_size]."""


GGML_TYPES = {
    0: GgmlType("F32", 1, 4, _float(torch.float32)),
    1: GgmlType("F16", 1, 2, _float(torch.float16)),
    2: GgmlType("Q4_0", 32, 18, _q4_0),
    3: GgmlType("Q4_1", 32, 20, _q4_1),
    8: GgmlType("Q8_0", 32, 34, _q8_0),
    30: GgmlType("BF16", 1, 2, _float(torch.bfloat16)),
}
"""GGML type number (gguf.GGMLQuantizationType) -> layout."""


def dequantize(raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [rows, bytes per row] of GGML type `type_id` -> [rows, columns] in `dtype`."""
    ggml = GGML_TYPES[type_id]
    blocks = raw.view(raw.shape[0], -1, ggml.block_bytes)
    return ggml.dequantize(blocks).reshape(raw.shape[0], -1).to(dtype)


class GgufMethod(QuantMethod):
    name = "gguf"
    loads_gguf_blocks = True
    requires = (DTYPE_VIEWS,)  # block scales and float blocks are bytes viewed as float16/bfloat16/float32

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        # Placeholders: sizes depend on each tensor's type, known only when it arrives.
        layer.gguf_parts = {"qweight": {}, "qweight_type": {}}
        for kind in layer.gguf_parts:
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = partial(_collect, layer.gguf_parts[kind])
            layer.register_parameter(kind, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = layer.gguf_parts
        device = layer.qweight.device
        layer.qweight_types = []
        for shard, rows in enumerate(layer.output_sizes):
            if shard not in parts["qweight"] or shard not in parts["qweight_type"]:
                raise ConfigError(
                    f"the GGUF weights lack part {shard} of a layer with parts {layer.output_sizes}"
                )
            raw, type_id = parts["qweight"][shard], int(parts["qweight_type"][shard])
            ggml = GGML_TYPES.get(type_id)
            if ggml is None:
                supported = ", ".join(t.name for t in GGML_TYPES.values())
                raise ConfigError(
                    f"GGUF tensor type {type_id} is not supported by --quantization gguf (supported: "
                    f"{supported}); load the file without --quantization to dequantize it at load time"
                )
            expected = (rows, layer.in_features // ggml.block_size * ggml.block_bytes)
            if layer.in_features % ggml.block_size or tuple(raw.shape) != expected:
                raise ConfigError(
                    f"a {ggml.name} GGUF tensor of {tuple(raw.shape)} bytes does not fit a [{rows}, "
                    f"{layer.in_features}] weight; the config does not match the weights"
                )
            layer.register_buffer(f"qweight_{shard}", raw.to(device))
            layer.qweight_types.append(type_id)
        del layer.qweight, layer.qweight_type, layer.gguf_parts

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        parts = [
            F.linear(x, dequantize(getattr(layer, f"qweight_{shard}"), type_id, x.dtype))
            for shard, type_id in enumerate(layer.qweight_types)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y if bias is None else y + bias


def _collect(store: dict[int, torch.Tensor], param: nn.Parameter, tensor: torch.Tensor, shard: int | None):
    store[shard or 0] = tensor


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [GgufMethod]
