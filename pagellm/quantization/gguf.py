"""`gguf`: llama.cpp's block formats kept quantized in memory, the file's bytes as they are.

The GGUF loader hands each linear weight over as two tensors: `<layer>.qweight`, the tensor's bytes as
uint8 [rows, bytes per row] in Hugging Face row order, and `<layer>.qweight_type`, its GGML type number.
A fused layer (q/k/v, gate/up) keeps one buffer per checkpoint tensor, since llama.cpp may give each a
different type.

Compute, per part, the first that applies:
- on CPU, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 and the
  codebook i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) are multiplied in place by the
  native kernel (`platforms.cpu_gguf`): x quantized to int8 in groups of 32, as llama.cpp does, integer
  dot products; a fused layer's parts in one call;
- on CUDA/ROCm with triton, the same types but MXFP4 and the codebook i-quants are multiplied by a Triton
  kernel that dequantizes each tile of the blocks in registers (`quantization.gguf_triton`), for steps of up to 32 rows; larger
  steps dequantize the part for the vendor matmul (vectorised torch, `GGML_TYPES`);
- elsewhere Q4_0, Q4_1, Q8_0 and the float types are dequantized for each matmul (vectorised torch, any
  device);
- any other type gguf-py can read (the ternary TQ types; the K-quants, Q5 and IQ types on a CPU without the
  kernels or a device without triton) is dequantized once at load into the model's dtype, which the log
  says with the memory it costs.

While the CPU kernels build in the background (a first start, `cpu_gguf.kernels_pending`), the parts,
tables and experts of the types they read are widened at load into the model's dtype ("pending": served as
"dense") and their bytes kept aside; `take_up_kernels` puts the bytes back on the kernel between two steps
once the build has ended, and the widened weights go.

A mixture-of-experts layer's stacked experts (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, uint8
[E, rows, bytes per row]) stay the file's bytes on CPU where all three are of the types above that the
kernel reads (`platforms.cpu_gguf_moe`: each step's experts multiplied in place, x quantized as for the
linears); otherwise (another type in any of the three, another device) the layer's experts are dequantized
at load into the model's dtype, logged as above, and run as float experts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.moe import PackedMoE
from pagellm.core.platform import DTYPE_VIEWS, PackedLinear
from pagellm.core.quant import QuantMethod
from pagellm.platforms import cpu_gguf, cpu_gguf_moe
from pagellm.plugins.hookspecs import hookimpl
from pagellm.quantization import gguf_triton

logger = logging.getLogger("pagellm")

PAGELLM_PLUGIN_API = "1.3"


def _scales(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [rows, blocks, 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibble_runs(packed: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [..., n * run] -> uint8 [..., 2 * n * run]: each run of `run` bytes gives `run` values from its
    low nibbles, then `run` from its high ones. Masked and shifted as int32 words (four bytes at a time,
    whole contiguous tensors): per byte, or into strided halves, these ops were most of a K-quant's
    widening at load (Q4_K 316 -> ~550 M weights/s on one thread of the AMX Xeon)."""
    words = packed.contiguous().view(torch.int32).unflatten(-1, (-1, 1, run // 4))
    low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
    return torch.cat([low, high], dim=-2).view(torch.uint8).flatten(-3)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles are elements 0-15, the high nibbles 16-31."""
    return _nibble_runs(packed, 16).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[..., 2:]) - 8) * _scales(blocks, 0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[..., 4:]) * _scales(blocks, 0) + _scales(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[..., 2:].contiguous().view(torch.int8).float() * _scales(blocks, 0)


_FIFTH_BIT_BYTES: dict[torch.device, torch.Tensor] = {}
"""Per device: for each byte value v, eight bytes whose byte j is 16 where bit j of v is set (one int64)."""


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 at byte `start`) at bit 4: [..., 32] of 0 or 16.
    Each byte of the word looked up as its eight values at once (a shift per bit over [..., 4, 8] took a
    third of Q5_0's widening)."""
    table = _FIFTH_BIT_BYTES.get(blocks.device)
    if table is None:
        values = torch.arange(256, device=blocks.device)[:, None] >> torch.arange(8, device=blocks.device)
        table = ((values & 1) << 4).to(torch.uint8).contiguous().view(torch.int64).view(256)
        _FIFTH_BIT_BYTES[blocks.device] = table
    codes = blocks[..., start : start + 4].long()
    return table[codes].view(torch.uint8).view(*codes.shape[:-1], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibble_runs(blocks[..., 6:], 16) | _fifth_bits(blocks, 2)).float()
    return _scales(blocks, 0) * (q - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibble_runs(blocks[..., 8:], 16) | _fifth_bits(blocks, 4)).float()
    return _scales(blocks, 0) * q + _scales(blocks, 2)


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and mins (bytes 4-15) as float32 [..., 8, 1] each."""
    s = blocks[..., 4:16]
    low, high, both = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], dim=-1)
    mins = torch.cat([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], dim=-1)
    return scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)


def _k_quant(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d * scale) * q - dmin * min per 32-weight sub-block, in gguf-py's order: q float32 [..., 8, 32]."""
    scales, mins = _k_scales_mins(blocks)
    d, dmin = _scales(blocks, 0).unsqueeze(-1), _scales(blocks, 2).unsqueeze(-1)
    return q.mul_(d * scales).sub_(dmin * mins).flatten(-2)  # in place: q is the caller's fresh float32


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [..., 8, 32]: each 32 bytes give 32 weights from their low nibbles, then 32 from the high."""
    return _nibble_runs(qs, 32).unflatten(-1, (8, 32))


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, _k_nibbles(blocks[..., 16:144]).float())


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = (
        blocks[..., 16:48].unsqueeze(-2) >> torch.arange(8, device=blocks.device, dtype=torch.uint8)[:, None]
    )
    return _k_quant(blocks, (_k_nibbles(blocks[..., 48:176]) | ((high & 1) << 4)).float())


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """ql: two halves of 64 bytes (low nibbles: weights 0-63 of a half, high: 64-127); qh: two halves of 32
    bytes, each byte's 2-bit pairs the fifth and sixth bits of four weights 32 apart; sixteen int8 scales."""
    ql = _nibble_runs(blocks[..., 0:128], 64)
    shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8)[:, None]
    qh = ((blocks[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3).flatten(-3)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).float().unflatten(-1, (16, 16))
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float().unsqueeze(-1)
    return ((_scales(blocks, 208).unsqueeze(-1) * scales) * q).flatten(-2)


def _two_bit_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 64 bytes of 2-bit codes -> [..., 256]: each 32 bytes give 32 weights from bits 0-1, then
    32 from bits 2-3, 4-5 and 6-7."""
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.uint8)[:, None]
    return ((qs.unflatten(-1, (2, 1, 32)) >> shifts) & 3).flatten(-3)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble the scale of 16 weights, high nibble their minimum), qs[64], d, dmin."""
    sc = blocks[..., 0:16]
    scales = _scales(blocks, 80).unsqueeze(-1) * (sc & 0xF).float().unsqueeze(-1)
    mins = _scales(blocks, 82).unsqueeze(-1) * (sc >> 4).float().unsqueeze(-1)
    q = _two_bit_codes(blocks[..., 16:80]).float().unflatten(-1, (16, 16))
    return (scales * q - mins).flatten(-2)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """hmask[32] (bit i of byte l: weight 32 i + l's third bit, clear meaning minus 4), qs[64], sixteen
    6-bit scales less 32 in 12 bytes (low nibbles from bytes 0-7, high pairs from bytes 8-11), d."""
    s = blocks[..., 96:108]
    nibble_shifts = torch.tensor([0, 4], device=blocks.device, dtype=torch.uint8)[:, None]
    pair_shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8)[:, None]
    low = (s[..., 0:8].unsqueeze(-2) >> nibble_shifts).flatten(-2) & 0xF
    high = (s[..., 8:12].unsqueeze(-2) >> pair_shifts).flatten(-2) & 3
    scales = ((low | (high << 4)).view(torch.int8) - 32).float()
    bit_shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8)[:, None]
    high_bits = ((blocks[..., 0:32].unsqueeze(-2) >> bit_shifts) & 1).flatten(-2)
    q = (
        _two_bit_codes(blocks[..., 32:96]).view(torch.int8) - ((high_bits ^ 1) << 2).view(torch.int8)
    ).float()
    return ((_scales(blocks, 108).unsqueeze(-1) * scales.unsqueeze(-1)) * q.unflatten(-1, (16, 16))).flatten(
        -2
    )


_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""What IQ4_NL's and IQ4_XS's nibbles stand for (times the scale): a grid denser near 0."""


def _iq4_grid(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] code bytes -> [..., 32] grid values (low nibbles first), float32."""
    grid = torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=qs.device)
    return grid[_nibble_runs(qs, 16).long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _scales(blocks, 0) * _iq4_grid(blocks[..., 2:18])


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """d, the scales' high pairs (a 16-bit word), their low nibbles (4 bytes), then 32 weights a 16 bytes."""
    nibble_shifts = torch.tensor([0, 4], device=blocks.device, dtype=torch.uint8)
    low = (blocks[..., 4:8].unsqueeze(-1) >> nibble_shifts).flatten(-2) & 0xF
    word = blocks[..., 2].int() | (blocks[..., 3].int() << 8)
    high = (word.unsqueeze(-1) >> torch.arange(0, 16, 2, device=blocks.device)) & 3
    scales = ((low.int() | (high << 4)) - 32).float()
    grid = _iq4_grid(blocks[..., 8:136].unflatten(-1, (8, 16)))
    return ((_scales(blocks, 0) * scales).unsqueeze(-1) * grid).flatten(-2)


_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""MXFP4's E2M1 codes as twice their values (GGML's block stores half the scale)."""


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """An E8M0 exponent byte e (the scale 2^(e - 128) as float32 bits: (e - 1) << 23, or the subnormal
    0x00200000 << e below 2, as ggml_e8m0_to_fp32_half), then 16 bytes of nibbles."""
    e = blocks[..., 0:1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    grid = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=blocks.device)
    qs = blocks[..., 1:17]
    return bits.view(torch.float32) * grid[_nibble_runs(qs, 16).long()]


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
    6: GgmlType("Q5_0", 32, 22, _q5_0),
    7: GgmlType("Q5_1", 32, 24, _q5_1),
    8: GgmlType("Q8_0", 32, 34, _q8_0),
    10: GgmlType("Q2_K", 256, 84, _q2_k),
    11: GgmlType("Q3_K", 256, 110, _q3_k),
    12: GgmlType("Q4_K", 256, 144, _q4_k),
    13: GgmlType("Q5_K", 256, 176, _q5_k),
    14: GgmlType("Q6_K", 256, 210, _q6_k),
    20: GgmlType("IQ4_NL", 32, 18, _iq4_nl),
    23: GgmlType("IQ4_XS", 256, 136, _iq4_xs),
    30: GgmlType("BF16", 1, 2, _float(torch.bfloat16)),
    39: GgmlType("MXFP4", 32, 17, _mxfp4),
}
"""GGML type number (gguf.GGMLQuantizationType) -> layout, with a vectorised torch dequantization equal to
gguf-py's bit for bit (float32)."""

PER_MATMUL_TYPES = frozenset((0, 1, 2, 3, 8, 30))
"""Types dequantized for each matmul where no kernel reads them (the "torch" path): those whose torch
dequantization is a few ops. The others widen at load there; the Triton path dequantizes any of GGML_TYPES
for steps too large for its kernel."""


_DEQUANTIZE_CHUNK_WEIGHTS = 1 << 17
"""Weights dequantized at a time on CPU: each float32 step between is then 0.5 MiB and stays in a core's L2.
One thread on the AMX Xeon, to bfloat16, in chunks of 1 MiB of blocks (as before) -> these: Q4_K 4096 x 4096
124 -> 302 M weights/s, 11008 x 4096 137 -> 308, 4096 x 11008 (fewer rows a chunk before too) 322 -> 293;
Q8_0 481-487 -> 523-525; Q6_K 274-289 -> 248-278. Chunks of 32K weights lose it again to each op's own cost."""


def dequantize(raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [rows, bytes per row] of GGML type `type_id` -> [rows, columns] in `dtype`."""
    ggml = GGML_TYPES[type_id]
    blocks = raw.view(raw.shape[0], -1, ggml.block_bytes)
    out = torch.empty(raw.shape[0], blocks.shape[1] * ggml.block_size, dtype=dtype, device=raw.device)
    # on CPU a few rows at a time, so that the float32 steps between stay in the cache; a device takes the
    # whole tensor in one launch of each step
    step = (
        max(1, _DEQUANTIZE_CHUNK_WEIGHTS // max(1, out.shape[1]))
        if raw.device.type == "cpu"
        else max(1, raw.shape[0])
    )
    for start in range(0, raw.shape[0], step):
        rows = blocks[start : start + step]
        out[start : start + step] = ggml.dequantize(rows).reshape(rows.shape[0], -1)
    return out


class GgufMethod(QuantMethod):
    name = "gguf"
    loads_gguf_blocks = True
    requires = (DTYPE_VIEWS,)  # block scales and float blocks are bytes viewed as float16/bfloat16/float32

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        super().__init__(quantization_config)
        self._tables: dict[str, dict[str, torch.Tensor]] = {}
        self._model: nn.Module | None = None
        """The model `prepare_model` gave, until its weights stream (`checkpoint_weights`)."""
        self._pending_tables: dict[str, dict[str, torch.Tensor]] = {}
        """The tables' blocks while the kernels build, packed by `take_up_kernels`."""
        self._row_lookups: dict[str, torch.dtype] = {}
        """Embeddings looked up on their blocks by torch while the kernels build, and their dtype."""

    def prepare_model(self, model: nn.Module) -> None:
        self._model = model

    def checkpoint_weights(self, weights, float_modules=()):
        """The stream without the token embedding's and output projection's blocks (`<module>.gguf_table`,
        `.gguf_table_type`, which come before the table's float weight). With the model given
        (`prepare_model`) and the CPU kernels here, a table the kernel reads is packed as soon as its blocks
        have come, and its float weight is dropped from the stream unread (the file's reader dequantizes it
        only when copied: model E's two tables, 0.9 s of its start). The others are kept aside for
        `process_model_after_loading`."""
        model, self._model = self._model, None
        packed: set[str] = set()
        for name, tensor in weights:
            module, _, attr = name.rpartition(".")
            if attr in ("gguf_table", "gguf_table_type"):
                parts = self._tables.setdefault(module, {})
                parts[attr] = tensor
                if len(parts) == 2 and model is not None and not cpu_gguf.kernels_pending():
                    if self._pack_table(model, module, parts):
                        packed.add(module)
                        del self._tables[module]
                elif len(parts) == 2 and model is not None and self._look_up_rows(model, module, parts):
                    packed.add(module)  # its blocks stay in `_tables`, for the kernels once built
            elif not (attr == "weight" and module in packed):
                yield name, tensor

    def process_model_after_loading(self, model: nn.Module) -> None:
        """The token embedding and output projection in block types multiplied in place where the CPU kernel
        reads their type: the embedding's rows dequantized per lookup, the logits from the same bytes when
        the projection is tied to it. Elsewhere they keep the float weights they were loaded with."""
        tables, self._tables = self._tables, {}
        if tables and cpu_gguf.kernels_pending() and _on_cpu(model):
            self._pending_tables = tables
            return
        self._pack_tables(model, tables)

    def _pack_tables(self, model: nn.Module, tables: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, parts in tables.items():
            self._pack_table(model, name, parts)

    def _look_up_rows(self, model: nn.Module, name: str, parts: dict[str, torch.Tensor]) -> bool:
        """While the CPU kernels build: an untied token embedding kept as its blocks, each step's rows
        dequantized by torch (`_row_lookup`), rather than the whole table widened at load (model E's,
        151936 rows of Q4_K: 2 s of a first start on two cores); whether it did. A tied one also gives
        the logits, which need the float table until the kernels come."""
        table, type_id = parts["gguf_table"], int(parts["gguf_table_type"])
        module = model.get_submodule(name)
        if (
            type_id not in GGML_TYPES
            or module is getattr(model, "lm_head", None)
            or not hasattr(module, "use_packed_table")
            or not _takes_table(module, table)
        ):
            return False
        self._row_lookups[name] = module.weight.dtype
        module.use_packed_table(
            table, partial(_row_lookup, type_id=type_id, dtype=module.weight.dtype), block_type=type_id
        )
        return True

    def _pack_table(self, model: nn.Module, name: str, parts: dict[str, torch.Tensor]) -> bool:
        """Module `name`'s table kept as its blocks, on the kernel, where the module takes them; whether it did."""
        table, type_id = parts["gguf_table"], int(parts["gguf_table_type"])
        module = model.get_submodule(name)
        if not cpu_gguf.has_kernel(type_id) or not (
            name in self._row_lookups
            or _takes_table(module, table)
            and (hasattr(module, "use_packed_table") or hasattr(module, "use_packed"))
        ):
            return False
        dtype = self._row_lookups.pop(name, None) or module.weight.dtype
        table, type_id = cpu_gguf.interleave(table, type_id)
        packed = PackedLinear(table, _GgufMatmul(type_id))
        if hasattr(module, "use_packed_table"):  # an embedding (pagellm.models.layers.Embedding)
            module.use_packed_table(table, partial(_lookup, type_id=type_id, dtype=dtype), block_type=type_id)
        else:  # an untied output projection (a Linear)
            module.use_packed(packed)
        if module is getattr(model, "lm_head", None):
            model.packed_lm_head = packed
        return True

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        # Placeholders: sizes depend on each tensor's type, known only when it arrives.
        layer.gguf_parts = {"qweight": {}, "qweight_type": {}}
        layer.gguf_dtype = params_dtype
        for kind in layer.gguf_parts:
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = partial(_collect, layer.gguf_parts[kind])
            layer.register_parameter(kind, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Each part as `qweight_{i}` (the file's bytes) with its compute path in `gguf_paths[i]`: "kernel"
        (the CPU kernel), "triton" (the Triton kernel), "torch" (dequantized per matmul), "dense"
        (dequantized here, `qweight_{i}` then holds the weight in the model's dtype) or "pending" (as
        "dense" while the CPU kernels build, the file's bytes kept in `gguf_pending[i]`)."""
        parts = layer.gguf_parts
        device = layer.qweight.device
        layer.qweight_types, layer.gguf_paths, layer.gguf_pending = [], [], {}
        for shard, rows in enumerate(layer.output_sizes):
            if shard not in parts["qweight"] or shard not in parts["qweight_type"]:
                raise ConfigError(
                    f"the GGUF weights lack part {shard} of a layer with parts {layer.output_sizes}"
                )
            raw, type_id = parts["qweight"][shard], int(parts["qweight_type"][shard])
            name = _type_name(type_id)
            block_size, block_bytes = _layout(type_id)
            expected = (rows, layer.in_features // block_size * block_bytes)
            if layer.in_features % block_size or tuple(raw.shape) != expected:
                raise ConfigError(
                    f"a {name} GGUF tensor of {tuple(raw.shape)} bytes does not fit a [{rows}, "
                    f"{layer.in_features}] weight; the config does not match the weights"
                )
            path = _compute_path(type_id, device)
            if path == "pending":
                layer.gguf_pending[shard] = raw
                raw = _widen(raw, type_id, layer.gguf_dtype)
            elif path == "dense":
                raw = _dequantize_at_load(raw, type_id, layer.gguf_dtype)
            elif path == "kernel":
                raw, type_id = cpu_gguf.interleave(raw, type_id)
            layer.register_buffer(f"qweight_{shard}", raw.to(device))
            layer.qweight_types.append(type_id)
            layer.gguf_paths.append(path)
        layer.gguf_kernel_only = all(path == "kernel" for path in layer.gguf_paths)
        del layer.qweight, layer.qweight_type, layer.gguf_parts

    def take_up_kernels(self, model: nn.Module) -> None:
        """Once the CPU kernels built in the background are here (between two steps): every part loaded
        "pending" back to the file's bytes on the kernel, its widened weight dropped, and the tables kept
        aside packed. A part whose type the kernels do not read after all (a failed build) stays widened."""
        for layer in model.modules():
            pending = getattr(layer, "gguf_pending", None)
            if not pending:
                continue
            for shard, raw in pending.items():
                type_id = layer.qweight_types[shard]
                if not cpu_gguf.has_kernel(type_id):
                    layer.gguf_paths[shard] = "dense"
                    continue
                raw, type_id = cpu_gguf.interleave(raw, type_id)
                layer.register_buffer(f"qweight_{shard}", raw)
                layer.qweight_types[shard], layer.gguf_paths[shard] = type_id, "kernel"
            layer.gguf_pending = {}
            layer.gguf_kernel_only = all(path == "kernel" for path in layer.gguf_paths)
        tables, self._pending_tables = self._pending_tables, {}
        self._pack_tables(model, tables)

    def waits_for_kernels(self, device: torch.device) -> bool:
        """On CPU while the kernels build in the background (`cpu_gguf.kernels_pending`)."""
        return device.type == "cpu" and cpu_gguf.kernels_pending()

    def pack_gguf_experts(
        self, blocks: dict[str, tuple[torch.Tensor, int]], activation: str, device: torch.device
    ) -> PackedMoE | None:
        """A layer's stacked experts on the CPU kernel that reads their blocks in place
        (`platforms.cpu_gguf_moe`) when all three projections are of types it reads; None otherwise (the
        layer dequantizes all three at load, `dequantize_gguf`)."""
        parts = [blocks[name] for name in ("gate_proj", "up_proj", "down_proj")]
        types = [type_id for _, type_id in parts]
        if device.type != "cpu" or not cpu_gguf_moe.runs(types):
            return None
        names = ", ".join(_type_name(t) for t in types)
        return cpu_gguf_moe.pack(*(raw for raw, _ in parts), types, activation, names)

    def dequantize_gguf(self, raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
        """What stays no block here, widened once as gguf-py does; logged once per type that has no kernel
        (a type that has one is here for another projection's type, or the device, which is logged)."""
        if cpu_gguf.has_kernel(type_id):
            return cpu_gguf.dequantize(raw, type_id).to(dtype)
        if type_id in cpu_gguf.KERNEL_TYPES and cpu_gguf.kernels_pending():
            return _widen(raw, type_id, dtype)
        return _dequantize_at_load(raw, type_id, dtype)

    def native_blocks(self, layer: nn.Module) -> list[tuple[torch.Tensor, int]] | None:
        """The parts on the CPU kernel as `apply` hands them to it (None where a part is not)."""
        if not layer.gguf_kernel_only:
            return None
        return [(getattr(layer, f"qweight_{i}"), t) for i, t in enumerate(layer.qweight_types)]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weights = [getattr(layer, f"qweight_{shard}") for shard in range(len(layer.qweight_types))]
        if layer.gguf_kernel_only and x.dtype in _KERNEL_DTYPES:
            y = cpu_gguf.linear(x, weights, layer.qweight_types)
        else:
            y = torch.cat(
                [
                    _part(x, w, type_id, path)
                    for w, type_id, path in zip(weights, layer.qweight_types, layer.gguf_paths, strict=True)
                ],
                dim=-1,
            )
        return y if bias is None else y + bias


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class _GgufMatmul:
    """A packed output projection's matmul (`PackedLinear.matmul`): hidden @ the table's rows^T."""

    def __init__(self, type_id: int):
        self.type_id = type_id

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = cpu_gguf.linear(x, [weight], [self.type_id])
        return y if bias is None else y + bias


def _lookup(ids: torch.Tensor, table: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_gguf.embedding(ids, table, type_id, dtype)


def _row_lookup(ids: torch.Tensor, table: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows of `ids`, dequantized by the vectorised torch code (no kernel needed)."""
    rows = dequantize(table[ids.reshape(-1)], type_id, dtype)
    return rows.view(*ids.shape, rows.shape[-1])


def _takes_table(module: nn.Module, table: torch.Tensor) -> bool:
    """Whether `module` (an embedding or output projection with its float weight still) may hold `table`
    as blocks: whole on this CPU, not quantized otherwise."""
    weight = getattr(module, "weight", None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and getattr(module, "group", None) is None  # a rank's rows of a sharded vocabulary
        and getattr(module, "shard", None) is None
        and getattr(module, "quant_method", None) is None
        and table.shape[0] == weight.shape[0]
    )


def _part(x: torch.Tensor, weight: torch.Tensor, type_id: int, path: str) -> torch.Tensor:
    """One part's x @ W^T outside the fused kernel call."""
    if path in ("dense", "pending"):
        return F.linear(x, weight.to(x.dtype))
    if path == "kernel" and x.dtype in _KERNEL_DTYPES:
        return cpu_gguf.linear(x, [weight], [type_id])
    if path == "kernel":
        return F.linear(x, cpu_gguf.dequantize(weight, type_id).to(x.dtype))
    if path == "triton" and x.numel() // x.shape[-1] <= gguf_triton.MAX_TOKENS:
        return gguf_triton.gguf_matmul(x, weight, type_id)
    return F.linear(x, dequantize(weight, type_id, x.dtype))


def _compute_path(type_id: int, device: torch.device) -> str:
    if device.type == "cpu" and type_id in cpu_gguf.KERNEL_TYPES and cpu_gguf.kernels_pending():
        return "pending"
    if device.type == "cpu" and cpu_gguf.has_kernel(type_id):
        return "kernel"
    if gguf_triton.runs(type_id, device):
        return "triton"
    return "torch" if type_id in PER_MATMUL_TYPES else "dense"


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        raise ConfigError(f"GGUF tensor type {type_id} is not a GGML type this gguf package knows") from None


def _layout(type_id: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]


def _on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def _widen(raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """A part of a type the kernels will read, widened for the time they build: vectorised torch where
    `GGML_TYPES` has the type (the bits of gguf-py's, every kernel type), else gguf-py's own code."""
    if type_id in GGML_TYPES:
        return dequantize(raw, type_id, dtype)
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType(type_id))).to(dtype)


_dense_types_logged: set[int] = set()


def _dequantize_at_load(raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
    """A part with no in-place path here, widened once by gguf-py (said once per type)."""
    from gguf import GGMLQuantizationType, quants

    name = _type_name(type_id)
    try:
        values = quants.dequantize(raw.numpy(), GGMLQuantizationType(type_id))
    except NotImplementedError:
        raise ConfigError(f"GGUF tensor type {name} cannot be read (gguf-py cannot dequantize it)") from None
    if type_id not in _dense_types_logged:
        _dense_types_logged.add(type_id)
        block_size, block_bytes = _layout(type_id)
        logger.info(
            "gguf: %s weights have no in-place kernel on this device; dequantized at load to %s (%.1fx "
            "their file size)",
            name,
            str(dtype).removeprefix("torch."),
            dtype.itemsize * block_size / block_bytes,
        )
    return torch.from_numpy(values).to(dtype)


def _collect(store: dict[int, torch.Tensor], param: nn.Parameter, tensor: torch.Tensor, shard: int | None):
    store[shard or 0] = tensor


@hookimpl
def pagellm_quant_methods() -> list[type[QuantMethod]]:
    return [GgufMethod]
