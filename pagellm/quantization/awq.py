"""`awq`: AutoAWQ "gemm" checkpoints, 4-bit weights with a zero point and a scale per group of inputs.

On disk, per linear layer (read by `matches_checkpoint` from `quantization_config.quant_method == "awq"`):
- `qweight` int32 [in, out / 8]: eight 4-bit values per word along the OUTPUT dimension, word nibble i
  (bits 4i..4i+3) holding column 8c + AWQ_ORDER[i];
- `qzeros` int32 [in / group, out / 8]: the zero points, packed the same way;
- `scales` float16 [in / group, out].
weight[o, i] = (q[i, o] - zero[i // group, o]) * scale[i // group, o]. On CPU, where the native kernels are
built, the weights become GGUF Q4_1 blocks at load (Q4_0 where every zero is 8; `int_blocks`) that the
GGUF kernel multiplies in place. Elsewhere compute dequantizes the whole weight into the activation dtype
for each matmul; on CUDA, batches of up to MAX_TOKENS tokens run the fused Triton kernel of
`packed_triton` instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.quant import QuantMethod
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization import int_blocks
from pagellm.quantization.packed import add_param, check_divisible, group_size_of, unpack
from pagellm.quantization.packed_triton import MAX_TOKENS, packed_matmul, triton_runs

PAGELLM_PLUGIN_API = "1.0"

BITS = 4
PACK = 32 // BITS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Column (within a block of 8) stored in nibble i of a word."""
AWQ_UNDO = tuple(AWQ_ORDER.index(column) for column in range(PACK))
"""Nibble holding column j: (0, 4, 1, 5, 2, 6, 3, 7)."""


class AwqMethod(QuantMethod):
    name = "awq"
    # requires nothing: int32 shifts and masks, gathers and a float matmul run on any torch device; the
    # Triton GEMM is a fast path taken at load where it runs (`triton_runs`), not a need

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        config = self.quantization_config
        if config.get("quant_method", "awq") != "awq":
            raise ConfigError(f"--quantization awq cannot read a {config['quant_method']!r} checkpoint")
        bits = config.get("bits", config.get("w_bit", BITS))
        if bits != BITS:
            raise ConfigError(f"awq checkpoints with {bits}-bit weights are not supported; only {BITS}-bit")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"awq version {version!r} has another layout; only 'gemm' checkpoints load")
        if not config.get("zero_point", True):
            raise ConfigError("awq checkpoints without zero points are not supported")

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        group = group_size_of(self.quantization_config, in_features, ("group_size", "q_group_size"))
        check_divisible("awq", "in_features", in_features, group, "the group size")
        for size in layer.output_sizes:
            check_divisible("awq", "output size", size, PACK, f"{PACK} values pack into one int32")
        groups = in_features // group
        layer.group_size = group
        add_param(layer, "qweight", (in_features, out_features // PACK), torch.int32, output_dim=1)
        add_param(layer, "qzeros", (groups, out_features // PACK), torch.int32, output_dim=1)
        add_param(layer, "scales", (groups, out_features), torch.float16, output_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.triton_gemm = triton_runs(layer.qweight)
        layer.cpu_block_type = None
        if int_blocks.runs_here(layer.qweight.device):
            in_features = layer.qweight.shape[0]
            blocks = int_blocks.to_blocks(
                unpack_awq(layer.qweight).t(),
                unpack_awq(layer.qzeros),
                layer.scales,
                torch.arange(in_features) // layer.group_size,
                BITS,
            )
            int_blocks.install_or_say(layer, blocks, "awq", ("qweight", "qzeros", "scales"))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.cpu_block_type is not None:
            y = int_blocks.apply(layer, x)
            return y if bias is None else y + bias
        packed = (layer.qweight, layer.qzeros, layer.scales)
        if layer.triton_gemm and x.numel() // x.shape[-1] <= MAX_TOKENS:
            y = packed_matmul(x, *packed, None, layer.group_size, bits=BITS, zero_offset=0, awq=True)
        else:
            y = torch.matmul(x, dequantize(*packed, layer.group_size, x.dtype))
        return y if bias is None else y + bias


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols] -> int32 [rows, cols * 8] in column order."""
    values = unpack(packed, BITS, dim=1).view(packed.shape[0], -1, PACK)
    return values[..., list(AWQ_UNDO)].reshape(packed.shape[0], -1)


def dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The transposed weight [in, out] in `dtype`."""
    q = unpack_awq(qweight)
    zeros = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    return (q - zeros).to(dtype) * scales.to(dtype).repeat_interleave(group_size, dim=0)


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [AwqMethod]
