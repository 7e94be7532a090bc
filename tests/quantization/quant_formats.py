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


def symmetric(weight: torch.Tensor, groups: torch.Tensor, num_groups: int, bits: int):
    """GPTQ's `sym=True`: per (output row, input group) the scale 2 max|w| / maxq and the zero point
    2^(bits-1), the same (q, zeros, scales) form as `asymmetric`."""
    maxq = (1 << bits) - 1
    scales = torch.stack([weight[:, groups == g].abs().amax(dim=1) for g in range(num_groups)])
    scales = (2 * scales / maxq).clamp(min=1e-5).half()
    zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int64)
    q = torch.clamp(torch.round(weight / scales.float()[groups].t()) + zeros[groups].t(), 0, maxq).long()
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


def gptq_quantizer(bits: int, group_size: int, desc_act: bool, v2: bool, sym: bool = False) -> Quantizer:
    def quantize(weight: torch.Tensor):
        in_features = weight.shape[1]
        g_idx = act_order(in_features, group_size) if desc_act else (torch.arange(in_features) // group_size)
        if sym:
            q, zeros, scales = symmetric(weight, g_idx.long(), in_features // group_size, bits)
        else:
            # v1 stores zero - 1: a zero of 0 would wrap, so (like symmetric GPTQ) keep zeros >= 1 there
            q, zeros, scales = asymmetric(
                weight, g_idx.long(), in_features // group_size, bits, 0 if v2 else 1
            )
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
    "gptq-4bit-sym-act-order": (
        "qwen2",
        GptqMethod,
        gptq_quantizer(4, 32, desc_act=True, v2=False, sym=True),
        dict(GPTQ, bits=4, group_size=32, desc_act=True, sym=True, checkpoint_format="gptq"),
    ),
    "gptq-8bit-sym": (
        "llama",
        GptqMethod,
        gptq_quantizer(8, 64, desc_act=False, v2=False, sym=True),
        dict(GPTQ, bits=8, group_size=64, desc_act=False, sym=True),
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


def k_quantize(weight: torch.Tensor, ggml_type) -> torch.Tensor:
    """A float weight [out, in] (in a multiple of 256) in llama.cpp's Q4_K, Q5_K or Q6_K blocks, uint8 [out,
    bytes per row]: round to nearest with each block's scales from its groups' ranges (gguf-py reads these
    types but cannot write them). Written from the format's description, not from pagellm's kernel."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    rows = weight.shape[0]
    v = weight.double().numpy().reshape(-1, 256)
    half = lambda a: np.asarray(a, np.float16)  # noqa: E731
    if ggml_type in (T.Q4_K, T.Q5_K):
        levels = 15 if ggml_type == T.Q4_K else 31
        g = v.reshape(-1, 8, 32)
        low = np.minimum(g.min(-1), 0)
        scale, minimum = (g.max(-1) - low) / levels, -low
        d, dmin = half(scale.max(-1) / 63), half(minimum.max(-1) / 63)
        df, dminf = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
        sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(
            np.uint8
        )
        mn = np.clip(np.round(np.divide(minimum, dminf, out=np.zeros_like(minimum), where=dminf > 0)), 0, 63)
        mn = mn.astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.divide(g + (dminf * mn)[..., None], step, out=np.zeros_like(g), where=step > 0)
        q = np.clip(np.round(q), 0, levels).astype(np.uint8)
        packed = np.zeros((v.shape[0], 12), np.uint8)
        packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
        nibbles = (q & 0xF).reshape(-1, 4, 2, 32)
        qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
        parts = [d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed]
        if ggml_type == T.Q5_K:
            high = (q >> 4) & 1  # [blocks, group, l] -> byte l holds group g's bit at g
            parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
        blocks = np.concatenate([*parts, qs], axis=1)
    elif ggml_type == T.Q6_K:
        g = v.reshape(-1, 16, 16)
        scale = np.abs(g).max(-1) / 31
        d = half(scale.max(-1) / 127)
        df = d.astype(np.float64)[:, None]
        sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
        step = (df * sc)[..., None]
        q = np.divide(g, step, out=np.zeros_like(g), where=step != 0)
        q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 8, 32)  # groups of 32
        ql, qh = np.zeros((v.shape[0], 128), np.uint8), np.zeros((v.shape[0], 64), np.uint8)
        for group in range(8):
            h, u = divmod(group, 4)
            byte = 64 * h + 32 * (u % 2)
            ql[:, byte : byte + 32] |= (q[:, group] & 0xF) << (4 * (u // 2))
            qh[:, 32 * h : 32 * h + 32] |= (q[:, group] >> 4) << (2 * u)
        blocks = np.concatenate(
            [ql, qh, sc.astype(np.int8).view(np.uint8), d.reshape(-1, 1).view(np.uint8)], 1
        )
    else:
        raise ValueError(f"k_quantize writes Q4_K, Q5_K and Q6_K, not {ggml_type!r}")
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))


def random_blocks(ggml_type, rows: int, columns: int, seed: int = 0, scale: float = 0.02):
    """Rows of `ggml_type` blocks with random codes and sub-scales and finite float16 scales: every byte
    pattern is a valid block once its float16 fields are."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, quants
    from gguf import GGMLQuantizationType as T

    half_fields = {
        T.Q4_0: (0, 1), T.Q4_1: (0, 2), T.Q5_0: (0, 1), T.Q5_1: (0, 2), T.Q8_0: (0, 1),
        T.Q2_K: (80, 2), T.Q3_K: (108, 1), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, 1),
        T.IQ4_NL: (0, 1), T.IQ4_XS: (0, 1), T.IQ2_XXS: (0, 1), T.TQ2_0: (64, 1),
    }  # fmt: skip
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal((rows, columns)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(values, ggml_type)).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    if ggml_type == T.MXFP4:  # the scale byte: 2^(e - 128) around scale / 4 (codes up to 12)
        center = 128 + int(np.round(np.log2(scale / 4)))
        raw[..., 0] = rng.integers(center - 2, center + 2, size=(rows, columns // block))
        return raw.reshape(rows, -1)
    start, count = half_fields[ggml_type]
    halves = (rng.standard_normal((rows, columns // block, count)) * scale).astype(np.float16)
    raw[..., start : start + 2 * count] = halves.view(np.uint8)
    return raw.reshape(rows, -1)
