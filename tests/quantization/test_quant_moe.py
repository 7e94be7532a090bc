"""Quantized experts: `--quantization int8|fp8` on a mixture-of-experts checkpoint quantizes its experts
too (weight-only, a float32 scale per output row), and int8/fp8 checkpoints whose experts are saved
quantized load. The oracle is transformers on the quantize-dequantize checkpoint (`write_quantized`: the
linears and experts quantized per row, the router not), which holds the very values the engine keeps.
The CPU kernel against the reference on quantized experts: tests/platforms/test_cpu_fused_moe.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]

from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import FORMATS, is_quantized_with_experts, write_quantized  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.models.layers.fused_moe.layer import FusedMoE  # noqa: E402

MAX_TOKENS = 8
CONFIG = {"int8": {"quant_method": "int8"}, "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


@pytest.fixture(scope="module", params=["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def checkpoint(request, tmp_path_factory):
    """(method, float checkpoint, quantized checkpoint, transformers on the dequantized weights)."""
    method = request.param
    root = tmp_path_factory.mktemp(f"moe-{method}")
    src = make_tiny_checkpoint("qwen3_moe", root)
    dst = root / "quantized"
    quantizer = FORMATS[method][2]
    dequantized = write_quantized(src, dst, quantizer, CONFIG[method], is_quantized_with_experts)
    return method, src, dst, Reference(dequantized, MAX_TOKENS)


def _engine(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=400, **kwargs)


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]


def test_quantizing_the_experts_while_loading(checkpoint):
    method, src, _, reference = checkpoint
    llm = _engine(src, quantization=method)
    layers = _experts(llm)
    assert layers and all(layer.weight_dtype == FORMATS[method][1].expert_dtype for layer in layers)
    assert all(
        f"{method.replace('fp8', 'float8_e4m3fn')} weight-only" in l.packed.description for l in layers
    )
    assert_greedy_parity(llm, reference, mixed_prompts(300)[:6])


@pytest.mark.slow
def test_a_checkpoint_with_quantized_experts_loads(checkpoint):
    method, _, quantized, reference = checkpoint
    llm = _engine(quantized)
    assert llm.engine.setup.quant_method.name == method  # detected from quantization_config
    assert_greedy_parity(llm, reference, mixed_prompts(300)[:6])


@pytest.mark.slow
def test_the_reference_path_runs_quantized_experts(checkpoint, monkeypatch):
    """Without the native kernels the layers keep their int8/fp8 experts and run the reference, which
    dequantizes the chosen experts step by step."""
    monkeypatch.setenv("PAGELLM_CPU_KERNELS", "0")
    from pagellm.platforms import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_why_not", None)
    method, src, _, reference = checkpoint
    llm = _engine(src, quantization=method)
    layers = _experts(llm)
    assert all(layer.packed is None and layer.w13.dtype == layer.weight_dtype for layer in layers)
    assert_greedy_parity(llm, reference, mixed_prompts(300)[:3])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_experts_take_a_quarter_of_float32(method, tmp_path):
    """Measured on the layers' tensors: one byte per weight, plus a float32 scale per output row."""
    src = make_tiny_checkpoint("qwen3_moe", tmp_path, moe_intermediate_size=48)
    plain = [m for m in load_pagellm(src).modules() if isinstance(m, FusedMoE)]
    quant = [
        m for m in load_pagellm(src, quant_method=FORMATS[method][1]()).modules() if isinstance(m, FusedMoE)
    ]

    def nbytes(layers: list[FusedMoE]) -> int:
        return sum(t.numel() * t.element_size() for layer in layers for t in layer.parameters())

    layer = plain[0]
    experts, width, hidden = layer.num_local_experts, layer.width, layer.hidden_size
    weights = len(plain) * experts * 3 * width * hidden
    scales = len(plain) * experts * (2 * width + hidden)
    assert nbytes(plain) == 4 * weights
    assert nbytes(quant) == weights + 4 * scales
    assert nbytes(quant) / nbytes(plain) < 0.27
