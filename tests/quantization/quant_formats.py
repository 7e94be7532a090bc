"""Quantized checkpoints written the way each format's tools write them, from a tiny float checkpoint.

Each writer quantizes every 2-d tensor of the decoder layers (round to nearest; the tools' calibration only
changes which values are chosen, not the layout), saves them in the format's on-disk layout with
`quantization_config` in config.json, and writes a twin checkpoint holding the DEQUANTIZED float weights,
which transformers loads as the reference. Packing is written here independently of pagellm's unpacking.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagellm.quantization.awq import AwqMethod
from pagellm.quantization.fp8 import Fp8Method
from pagellm.quantization.gptq import GptqMethod
from pagellm.quantization.int8 import Int8Method

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
"""float weight [out, in] -> (tensors to save under the layer's prefix, dequantized weight [out, in])."""


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return ".layers." in name and name.endswith(".weight") and tensor.dim() == 2


def is_quantized_with_experts(name: str, tensor: torch.Tensor) -> bool:
    """A mixture-of-experts checkpoint as quantizing tools write it: the linears and every expert's
    matrices, not the router (`mlp.gate`, which stays in the model's dtype)."""
    return is_quantized(name, tensor) and not name.endswith(".mlp.gate.weight")


def write_quantized(
    src: Path,
    dst: Path,
    quantizer: Quantizer,
    config: dict,
    select: Callable[[str, torch.Tensor], bool] = is_quantized,
) -> Path:
    """Write `dst` (quantized, with `config` as quantization_config) and `dst`-dequant; return the latter.
    `select` says which tensors are quantized."""
    state = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(path))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if select(name, tensor):
            prefix = name.removesuffix(".weight")
            saved, deq = quantizer(tensor.float())
            quantized.update({f"{prefix}.{key}": value.contiguous() for key, value in saved.items()})
            dequantized[name] = deq.to(tensor.dtype)
        else:
            quantized[name] = dequantized[name] = tensor
    reference = dst.with_name(dst.name + "-dequant")
    for out, tensors, quant in ((dst, quantized, config), (reference, dequantized, None)):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.json"))
        for path in src.glob("*.json"):
            if path.name != "model.safetensors.index.json":
                shutil.copy(path, out / path.name)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if quant is not None:
            hf_config = json.loads((out / "config.json").read_text())
            hf_config["quantization_config"] = quant
            (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return reference


# int8 / fp8: per-output-channel symmetric, weight + weight_scale [out, 1]


def int8_quantizer(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    q = torch.clamp(torch.round(weight / scale), -127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_quantizer(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    q = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_per_tensor_quantizer(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoFP8's layout: one scalar scale per tensor."""
    scale = weight.abs().max() / 448
    q = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_block_quantizer(block: tuple[int, int], requantize: bool) -> Quantizer:
    """Block-wise fp8 as DeepSeek's and Qwen's tools write it: e4m3 `weight` and float32 `weight_scale_inv`
    [ceil(out / bm), ceil(in / bn)], each block's max |w| / 448 (edge blocks partial). The dequantized
    weight is q * scale_inv, or with `requantize` what pagellm keeps of it: those values quantized again
    with one scale per row (`fp8_quantizer`)."""

    def quantize(weight: torch.Tensor):
        rows, cols = weight.shape
        bm, bn = block
        scale_inv = torch.empty(-(-rows // bm), -(-cols // bn))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        deq = torch.empty(rows, cols)
        for i in range(scale_inv.shape[0]):
            for j in range(scale_inv.shape[1]):
                part = weight[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
                scale_inv[i, j] = part.abs().max() / 448
                q_part = (part / scale_inv[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
                q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = q_part
                deq[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = q_part.float() * scale_inv[i, j]
        return {"weight": q, "weight_scale_inv": scale_inv}, fp8_quantizer(deq)[1] if requantize else deq

    return quantize


# AWQ (AutoAWQ gemm) and GPTQ (AutoGPTQ / GPTQModel)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned `bits`-bit values along `dim`: word slot i holds element `order[i]` of its block."""
    per = 32 // bits
    order = order or list(range(per))
    v = values.long().movedim(dim, -1)
    blocks = v.reshape(*v.shape[:-1], -1, per)
    word = torch.zeros(blocks.shape[:-1], dtype=torch.int64)
    for slot, element in enumerate(order):
        word |= (blocks[..., element] & ((1 << bits) - 1)) << (bits * slot)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim)


def asymmetric(weight: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int, min_zero: int = 0):
    """Round-to-nearest per (output row, input group): (q [out, in], zeros [groups, out], scales fp16)."""
    maxq = (1 << bits) - 1
    out_features = weight.shape[0]
    scales = torch.empty(num_groups, out_features)
    zeros = torch.empty(num_groups, out_features, dtype=torch.int64)
    for g in range(num_groups):
        cols = weight[:, groups == g]
        lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
        scales[g] = ((hi - lo) / maxq).clamp(min=1e-5)
        zeros[g] = torch.round(-lo / scales[g]).clamp(min_zero, maxq).long()
    scales = scales.half()
    s, z = scales.float()[groups].t(), zeros[groups].t()
    q = torch.clamp(torch.round(weight / s) + z, 0, maxq).long()
    return q, zeros, scales


def awq_quantizer(group_size: int) -> Quantizer:
    def quantize(weight: torch.Tensor):
        in_features = weight.shape[1]
        groups = torch.arange(in_features) // group_size
        q, zeros, scales = asymmetric(weight, groups, in_features // group_size, 4)
        deq = (q - zeros[groups].t()).float() * scales.float()[groups].t()
        saved = {
            "qweight": pack_int32(q.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zeros, 4, dim=1, order=AWQ_ORDER),
            "scales": scales,
        }
        return saved, deq

    return quantize


def act_order(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx of desc_act: groups follow a permutation of the inputs. Seeded by the input size, so layers
    that share an input (q/k/v, gate/up) share it, as GPTQ's Hessian order does."""
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))
    return (torch.argsort(perm) // group_size).int()


def gptq_quantizer(bits: int, group_size: int, desc_act: bool, v2: bool) -> Quantizer:
    def quantize(weight: torch.Tensor):
        in_features = weight.shape[1]
        g_idx = act_order(in_features, group_size) if desc_act else (torch.arange(in_features) // group_size)
        # v1 stores zero - 1: a zero of 0 would wrap, so (like symmetric GPTQ) keep zeros >= 1 there
        q, zeros, scales = asymmetric(weight, g_idx.long(), in_features // group_size, bits, 0 if v2 else 1)
        deq = (q - zeros[g_idx.long()].t()).float() * scales.float()[g_idx.long()].t()
        saved = {
            "qweight": pack_int32(q.t(), bits, dim=0),
            "qzeros": pack_int32(zeros if v2 else zeros - 1, bits, dim=1),
            "scales": scales,
            "g_idx": g_idx.int(),
        }
        return saved, deq

    return quantize


GPTQ = {"quant_method": "gptq", "sym": False, "lm_head": False}
FORMATS = {  # name: (architecture, method, quantizer, quantization_config)
    "int8": ("llama", Int8Method, int8_quantizer, {"quant_method": "int8"}),
    "fp8": ("qwen2", Fp8Method, fp8_quantizer, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "fp8-per-tensor": ("llama", Fp8Method, fp8_per_tensor_quantizer, {"quant_method": "fp8"}),
    "awq": (
        "qwen2",
        AwqMethod,
        awq_quantizer(32),
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    ),
    "gptq-4bit": (
        "llama",
        GptqMethod,
        gptq_quantizer(4, 32, desc_act=False, v2=False),
        dict(GPTQ, bits=4, group_size=32, desc_act=False, checkpoint_format="gptq"),
    ),
    "gptq-4bit-act-order-v2": (
        "qwen3",
        GptqMethod,
        gptq_quantizer(4, 16, desc_act=True, v2=True),
        dict(GPTQ, bits=4, group_size=16, desc_act=True, checkpoint_format="gptq_v2"),
    ),
    "gptq-8bit-act-order": (
        "llama",
        GptqMethod,
        gptq_quantizer(8, 32, desc_act=True, v2=False),
        dict(GPTQ, bits=8, group_size=32, desc_act=True),
    ),
}


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "quant_method", None) is not None}


def quantized_linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantized layers' weight tensors (scales, zeros and indices included; biases not)."""
    return sum(
        t.numel() * t.element_size()
        for m in quantized_layers(model).values()
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if t is not getattr(m, "bias", None)
    )


def plain_linear_bytes(model: torch.nn.Module) -> int:
    """Weight bytes of an unquantized model's decoder-layer linear layers (what a quant method replaces)."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for name, m in model.named_modules()
        if name.split(".")[-1].endswith(("proj", "fc1", "fc2")) and ".layers." in name
    )
