"""int8, fp8, AWQ and GPTQ: checkpoints in each format's on-disk layout load, every quantized layer equals
the dequantized weights, greedy outputs equal transformers on those dequantized weights, and the weight
memory shrinks as the format promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagellm import LLM
from pagellm.core.errors import ConfigError
from pagellm.models.layers.linear import Linear
from pagellm.models.llama import STACKED
from pagellm.models.loader import model_weight_bytes
from pagellm.quantization.awq import AwqMethod, unpack_awq
from pagellm.quantization.fp8 import Fp8Method, scaled_mm_linear
from pagellm.quantization.gptq import GptqMethod
from pagellm.quantization.int8 import Int8Method
from pagellm.quantization.packed import unpack

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]
from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import (  # noqa: E402
    awq_quantizer,
    fp8_per_tensor_quantizer,
    fp8_quantizer,
    gptq_quantizer,
    int8_quantizer,
    write_quantized,
)
from tiny import make_tiny_checkpoint  # noqa: E402

MAX_TOKENS = 8
GPTQ = {"quant_method": "gptq", "sym": False, "lm_head": False}
FORMATS = {
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


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tmp_path_factory):
    """(format name, quantized dir, dequantized reference dir)."""
    arch, _, quantizer, config = FORMATS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_checkpoint(arch, root)
    dst = root / "quantized"
    return request.param, dst, write_quantized(src, dst, quantizer, config)


def engine(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=400, **kwargs)


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "quant_method", None) is not None}


def test_each_layer_reproduces_the_dequantized_weights(checkpoint):
    name, quantized, dequantized = checkpoint
    _, method_cls, _, config = FORMATS[name]
    model = load_pagellm(quantized, quant_method=method_cls(config))
    reference = load_file(dequantized / "model.safetensors")
    layers = quantized_layers(model)
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    for layer_name, layer in layers.items():
        parts = [p for fused, p, _ in STACKED if layer_name.endswith(fused)]
        prefix = layer_name.rsplit(".", 1)[0]
        names = [f"{prefix}.{p}.weight" for p in parts] or [f"{layer_name}.weight"]
        expected = torch.cat([reference[n] for n in names])
        eye = torch.eye(layer.in_features)
        got = layer.quant_method.apply(layer, eye).t()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=layer_name)


def test_greedy_outputs_equal_transformers_on_dequantized_weights(checkpoint):
    name, quantized, dequantized = checkpoint
    llm = engine(quantized)  # the format comes from the checkpoint's quantization_config
    assert llm.engine.setup.quant_method is FORMATS[name][1]
    assert_greedy_parity(llm, Reference(dequantized, MAX_TOKENS), mixed_prompts(300)[:8])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantizing_an_unquantized_checkpoint_while_loading(method, tmp_path):
    quantizer = {"int8": int8_quantizer, "fp8": fp8_quantizer}[method]
    src = make_tiny_checkpoint("llama", tmp_path)
    dequantized = write_quantized(src, tmp_path / "unused", quantizer, {"quant_method": method})
    llm = engine(src, quantization=method)
    assert llm.engine.setup.quant_method.name == method
    assert_greedy_parity(llm, Reference(dequantized, MAX_TOKENS), mixed_prompts(300)[:8])


WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def linear_bytes(model: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in quantized_layers(model).values()
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if t is not getattr(m, "bias", None)
    )


@pytest.mark.parametrize(
    ("method", "dtype", "ratio"), [("int8", torch.bfloat16, 0.5), ("fp8", torch.float32, 0.25)]
)
def test_weight_memory_of_quantizing_while_loading(method, dtype, ratio, tmp_path):
    src = make_tiny_checkpoint("llama", tmp_path, dtype=dtype, **WIDE)
    plain = load_pagellm(src, dtype)
    quant = load_pagellm(src, dtype, quant_method=FORMATS[method][1]())
    # one byte per weight, plus a float32 scale per output row
    assert linear_bytes(quant) / plain_linear_bytes(plain) == pytest.approx(ratio, rel=0.02)
    assert model_weight_bytes(quant) < model_weight_bytes(plain)


@pytest.mark.parametrize("fmt", ["awq", "gptq-4bit"])
def test_weight_memory_of_4bit_checkpoints(fmt, tmp_path):
    arch, method_cls, quantizer, config = FORMATS[fmt]
    src = make_tiny_checkpoint(arch, tmp_path, dtype=torch.bfloat16, **WIDE)
    write_quantized(src, tmp_path / "q", quantizer, config)
    plain = load_pagellm(src, torch.bfloat16)
    quant = load_pagellm(tmp_path / "q", torch.bfloat16, quant_method=method_cls(config))
    # 4 of 16 bits per weight, plus a float16 scale and a 4-bit zero per group of 32 (and gptq's g_idx)
    assert 0.25 < linear_bytes(quant) / plain_linear_bytes(plain) < 0.30
    assert model_weight_bytes(quant) < model_weight_bytes(plain)


def plain_linear_bytes(model: torch.nn.Module) -> int:
    """Weight bytes of the decoder layers' linear layers (what a quant method replaces)."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for name, m in model.named_modules()
        if isinstance(m, Linear) and ".layers." in name
    )


def test_awq_unpacks_its_interleaved_column_order():
    # columns 0..7 hold values 0..7; nibble i (lowest first) holds column AWQ_ORDER[i] = 0,2,4,6,1,3,5,7
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_awq(word).tolist() == [list(range(8))]


def test_gptq_unpacks_sequentially_along_the_input_dimension():
    words = torch.tensor([[0x76543210, -0x01234568]], dtype=torch.int32)  # second word: 0xFEDCBA98
    assert unpack(words, 4, dim=0)[:, 0].tolist() == list(range(8))
    assert unpack(words, 4, dim=0)[:, 1].tolist() == list(range(8, 16))
    assert unpack(words, 8, dim=1).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]


def test_fp8_scaled_mm_path_approximates_the_weight_only_result():
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(5, 64, dtype=torch.bfloat16)
    qweight, scale = Fp8Method.quantize(weight)
    exact = x.float() @ (qweight.float() * scale).t()
    got = scaled_mm_linear(x, qweight, scale, None)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() < 0.06 * exact.abs().max()


def test_refusals():
    with pytest.raises(ConfigError, match="static"):
        Fp8Method({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ConfigError, match="weight_block_size"):
        Fp8Method({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="'gptq'"):
        Int8Method({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ConfigError, match="3-bit"):
        GptqMethod({"quant_method": "gptq", "bits": 3})
    with pytest.raises(ConfigError, match="gemv"):
        AwqMethod({"quant_method": "awq", "version": "gemv"})


def test_gptq_refuses_fused_shards_with_different_act_orders(tmp_path):
    _, _, _, config = FORMATS["gptq-4bit-act-order-v2"]
    src = make_tiny_checkpoint("llama", tmp_path)
    dst = tmp_path / "q"
    write_quantized(src, dst, gptq_quantizer(4, 16, desc_act=True, v2=True), config)
    state = load_file(dst / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    from safetensors.torch import save_file

    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="different g_idx"):
        load_pagellm(dst, quant_method=GptqMethod(config))
