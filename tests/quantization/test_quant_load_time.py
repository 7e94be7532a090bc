"""`--quantization int8|fp8` on an unquantized checkpoint quantizes while loading, and quantized weights
take the memory each format promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]

from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import (  # noqa: E402
    FORMATS,
    fp8_quantizer,
    int8_quantizer,
    plain_linear_bytes,
    quantized_linear_bytes,
    write_quantized,
)
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.models.loader import model_weight_bytes  # noqa: E402
from pagellm.quantization import int_blocks  # noqa: E402

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantizing_an_unquantized_checkpoint_while_loading(method, tmp_path):
    quantizer = {"int8": int8_quantizer, "fp8": fp8_quantizer}[method]
    src = make_tiny_checkpoint("llama", tmp_path)
    dequantized = write_quantized(src, tmp_path / "unused", quantizer, {"quant_method": method})
    llm = LLM(str(src), dtype="float32", num_kv_blocks=200, max_model_len=400, quantization=method)
    assert llm.engine.setup.quant_method.name == method
    assert_greedy_parity(llm, Reference(dequantized, 8), mixed_prompts(300)[:8])


@pytest.mark.parametrize(
    ("method", "dtype", "ratio"), [("int8", torch.bfloat16, 0.5), ("fp8", torch.float32, 0.25)]
)
def test_weight_memory_of_quantizing_while_loading(method, dtype, ratio, tmp_path):
    src = make_tiny_checkpoint("llama", tmp_path, dtype=dtype, **WIDE)
    plain = load_pagellm(src, dtype)
    quant = load_pagellm(src, dtype, quant_method=FORMATS[method][1]())
    # one byte per weight, plus a float32 scale per output row
    assert quantized_linear_bytes(quant) / plain_linear_bytes(plain) == pytest.approx(ratio, rel=0.02)
    assert model_weight_bytes(quant) < model_weight_bytes(plain)


@pytest.mark.parametrize("fmt", ["awq", "gptq-4bit"])
def test_weight_memory_of_4bit_checkpoints(fmt, tmp_path):
    arch, method_cls, quantizer, config = FORMATS[fmt]
    src = make_tiny_checkpoint(arch, tmp_path, dtype=torch.bfloat16, **WIDE)
    write_quantized(src, tmp_path / "q", quantizer, config)
    plain = load_pagellm(src, torch.bfloat16)
    quant = load_pagellm(tmp_path / "q", torch.bfloat16, quant_method=method_cls(config))
    ratio = quantized_linear_bytes(quant) / plain_linear_bytes(plain)
    if int_blocks.runs_here(torch.device("cpu")):  # Q4_1 blocks: 16 bytes of codes, d and m per 32
        assert ratio == pytest.approx(5 / 16, rel=0.01)
    else:  # 4 of 16 bits per weight, a float16 scale and a 4-bit zero per group of 32 (and gptq's g_idx)
        assert 0.25 < ratio < 0.30
    assert model_weight_bytes(quant) < model_weight_bytes(plain)
