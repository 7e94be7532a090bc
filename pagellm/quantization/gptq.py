"""`gptq`: AutoGPTQ / GPTQModel checkpoints, 4- or 8-bit weights with per-group zero points and scales.

On disk, per linear layer (read by `matches_checkpoint` from `quantization_config.quant_method == "gptq"`):
- `qweight` int32 [in * bits / 32, out]: packed along the INPUT dimension, row 32/bits * r + j of the
  weight in bits j*bits.. of word row r;
- `qzeros` int32 [groups, out * bits / 32]: packed along the output dimension the same way; the
  "gptq" (v1) checkpoint_format stores zero - 1, "gptq_v2" the zero itself;
- `scales` float16 [groups, out];
- `g_idx` int32 [in]: the group of each input row (with act-order, `desc_act`, not simply row // group).
weight[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]. On CPU, where the native kernels are
built, the weights become GGUF blocks at load (4-bit: Q4_1, or Q4_0 where every zero is 8; 8-bit with
every zero 128: Q8_0; act-order as a permutation of the inputs; `int_blocks`) that the GGUF kernel
multiplies in place. Elsewhere, and for layouts no block type holds, compute dequantizes the whole weight
into the activation dtype for each matmul; on CUDA, batches of up to MAX_TOKENS tokens run the fused
Triton kernel of `packed_triton` instead.
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

SUPPORTED_BITS = (4, 8)
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""checkpoint_format -> what to add to the stored zero points."""


class GptqMethod(QuantMethod):
    name = "gptq"
    # requires nothing: int32 shifts and masks, gathers and a float matmul run on any torch device; the
    # Triton GEMM is a fast path taken at load where it runs (`triton_runs`), not a need

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        config = self.quantization_config
        if config.get("quant_method", "gptq") != "gptq":
            raise ConfigError(f"--quantization gptq cannot read a {config['quant_method']!r} checkpoint")
        self.bits = int(config.get("bits", 4))
        if self.bits not in SUPPORTED_BITS:
            raise ConfigError(
                f"gptq checkpoints with {self.bits}-bit weights are not supported; only "
                f"{', '.join(map(str, SUPPORTED_BITS))}-bit"
            )
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ConfigError(
                f"gptq checkpoint_format {checkpoint_format!r} is not supported; "
                f"only {', '.join(CHECKPOINT_FORMATS)}"
            )
        self.zero_offset = CHECKPOINT_FORMATS[checkpoint_format]
        if config.get("lm_head"):
            raise ConfigError("gptq checkpoints with a quantized lm_head are not supported")

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        pack = 32 // self.bits
        group = group_size_of(self.quantization_config, in_features)
        check_divisible("gptq", "in_features", in_features, pack, f"{pack} values pack into one int32")
        check_divisible("gptq", "in_features", in_features, group, "the group size")
        for size in layer.output_sizes:
            check_divisible("gptq", "output size", size, pack, f"{pack} zero points pack into one int32")
        groups = in_features // group
        add_param(layer, "qweight", (in_features // pack, out_features), torch.int32, output_dim=1)
        add_param(layer, "qzeros", (groups, out_features // pack), torch.int32, output_dim=1)
        add_param(layer, "scales", (groups, out_features), torch.float16, output_dim=1)
        # One row per fused shard: each checkpoint tensor (q, k, v) has its own g_idx, and they must agree.
        g_idx = add_param(layer, "g_idx", (len(layer.output_sizes), in_features), torch.int32, None)
        g_idx.weight_loader = _load_g_idx

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[0]).all()):
            raise ConfigError(
                "the fused shards of a gptq layer (q/k/v or gate/up) have different g_idx; "
                "this engine fuses them and needs one act-order per layer input"
            )
        if int(g_idx.max()) >= layer.scales.shape[0] or int(g_idx.min()) < 0:
            raise ConfigError("a gptq g_idx names a group the layer does not have")
        layer.g_idx = nn.Parameter(g_idx[0].clone(), requires_grad=False)
        layer.triton_gemm = triton_runs(layer.qweight)
        layer.cpu_block_type = None
        if int_blocks.runs_here(layer.qweight.device):
            blocks = int_blocks.to_blocks(
                unpack(layer.qweight, self.bits, dim=0).t(),
                unpack(layer.qzeros, self.bits, dim=1) + self.zero_offset,
                layer.scales,
                layer.g_idx,
                self.bits,
            )
            int_blocks.install_or_say(layer, blocks, "gptq", ("qweight", "qzeros", "scales", "g_idx"))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.cpu_block_type is not None:
            y = int_blocks.apply(layer, x)
            return y if bias is None else y + bias
        packed = (layer.qweight, layer.qzeros, layer.scales, layer.g_idx)
        if layer.triton_gemm and x.numel() // x.shape[-1] <= MAX_TOKENS:
            y = packed_matmul(
                x, *packed, group_size=0, bits=self.bits, zero_offset=self.zero_offset, awq=False
            )
        else:
            y = torch.matmul(x, dequantize(*packed, self.bits, self.zero_offset, x.dtype))
        return y if bias is None else y + bias


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    zero_offset: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The transposed weight [in, out] in `dtype`."""
    q = unpack(qweight, bits, dim=0)
    zeros = unpack(qzeros, bits, dim=1) + zero_offset
    return (q - zeros[g_idx]).to(dtype) * scales.to(dtype)[g_idx]


def _load_g_idx(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
    rows = param.data if shard is None else param.data[shard]
    if tensor.shape != rows.shape[-1:]:
        raise ConfigError(
            f"gptq g_idx of shape {tuple(tensor.shape)} does not fit {tuple(rows.shape[-1:])}; "
            f"the config does not match the weights"
        )
    rows.copy_(tensor)


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [GptqMethod]
