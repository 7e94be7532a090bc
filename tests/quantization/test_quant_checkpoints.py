"""int8, fp8, AWQ and GPTQ checkpoints in each format's on-disk layout: the format is detected from
quantization_config, every quantized layer equals the dequantized weights (exactly, except the float16
offsets of AWQ/GPTQ layers kept as Q4_1 blocks on CPU), and greedy outputs equal transformers run on
those dequantized weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(TESTS / "engine"), str(Path(__file__).parent)]

from models_harness import load_pagellm  # noqa: E402
from parity import Reference, assert_greedy_parity, mixed_prompts  # noqa: E402
from quant_formats import FORMATS, gptq_quantizer, quantized_layers, write_quantized  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.core.errors import ConfigError  # noqa: E402
from pagellm.models.llama import STACKED  # noqa: E402
from pagellm.platforms import cpu_gguf  # noqa: E402
from pagellm.quantization import int_blocks  # noqa: E402
from pagellm.quantization.awq import AwqMethod  # noqa: E402
from pagellm.quantization.gptq import GptqMethod  # noqa: E402

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoint(request, tmp_path_factory):
    """(format name, quantized dir, dequantized reference dir)."""
    arch, _, quantizer, config = FORMATS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_checkpoint(arch, root)
    dst = root / "quantized"
    return request.param, dst, write_quantized(src, dst, quantizer, config)


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
        got = layer.quant_method.apply(layer, torch.eye(layer.in_features)).t()
        # Q4_1's offset -z s is a float16: off by at most 2^-11 of |z s| <= 16/15 max |w| (int_blocks)
        q4_1 = cpu_gguf.base_type(getattr(layer, "cpu_block_type", None) or 0) == int_blocks.Q4_1
        atol = 2**-11 * 16 / 15 * float(expected.abs().max()) if q4_1 else 0
        torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=layer_name)


BLOCKS = {  # format -> the GGUF block type its layers become on CPU (int_blocks); others keep their layout
    "awq": int_blocks.Q4_1,
    "gptq-4bit": int_blocks.Q4_1,
    "gptq-4bit-sym-act-order": int_blocks.Q4_0,
    "gptq-8bit-sym": int_blocks.Q8_0,
}


def test_cpu_keeps_awq_and_gptq_layers_as_blocks_only(checkpoint):
    name, quantized, _ = checkpoint
    _, method_cls, _, config = FORMATS[name]
    if method_cls not in (AwqMethod, GptqMethod) or not int_blocks.runs_here(torch.device("cpu")):
        pytest.skip("not an integer format, or no CPU kernels here")
    bits_per_weight = {int_blocks.Q4_0: 4.5, int_blocks.Q4_1: 5, int_blocks.Q8_0: 8.5}
    model = load_pagellm(quantized, quant_method=method_cls(config))
    for layer_name, layer in quantized_layers(model).items():
        if name not in BLOCKS:
            assert layer.cpu_block_type is None, layer_name
            continue
        # rows of whole 128-weight super-blocks interleaved (`cpu_gguf.interleave`), the same bytes
        interleaved = layer.in_features % 128 == 0
        assert layer.cpu_block_type == BLOCKS[name] + interleaved * cpu_gguf.INTERLEAVED, layer_name
        assert not hasattr(layer, "qweight") and layer.cpu_blocks.dtype == torch.uint8
        weights = layer.in_features * layer.cpu_blocks.shape[0]
        assert layer.cpu_blocks.numel() * 8 == weights * bits_per_weight[BLOCKS[name]]
    assert any(layer.in_features % 128 == 0 for layer in quantized_layers(model).values())


def test_greedy_outputs_equal_transformers_on_dequantized_weights(checkpoint):
    name, quantized, dequantized = checkpoint
    llm = LLM(str(quantized), dtype="float32", num_kv_blocks=200, max_model_len=400)
    assert llm.engine.setup.quant_method is FORMATS[name][1]  # detected from quantization_config
    assert_greedy_parity(llm, Reference(dequantized, MAX_TOKENS), mixed_prompts(300)[:8])


def test_gptq_refuses_fused_shards_with_different_act_orders(tmp_path):
    _, _, _, config = FORMATS["gptq-4bit-act-order-v2"]
    src = make_tiny_checkpoint("llama", tmp_path)
    dst = tmp_path / "q"
    write_quantized(src, dst, gptq_quantizer(4, 16, desc_act=True, v2=True), config)
    state = load_file(dst / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="different g_idx"):
        load_pagellm(dst, quant_method=GptqMethod(config))
