"""The AWQ/GPTQ Triton GEMM under the Triton interpreter on CPU tensors: equal to the torch
dequantize-and-matmul path, alone and wired into the layers (the kernel reads TRITON_INTERPRET when it is
first compiled, on the first call, so setting it here is enough)."""

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "models"), str(Path(__file__).parent)]
from models_harness import PagedRunner, load_pagellm  # noqa: E402
from quant_formats import FORMATS, awq_quantizer, gptq_quantizer, quantized_layers, write_quantized  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm.quantization import awq, gptq  # noqa: E402
from pagellm.quantization.packed_triton import packed_matmul  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
CASES = {  # name: (quantizer, bits, zero offset, group size)
    "awq-g16": (awq_quantizer(16), 4, 0, 16),
    "gptq-4bit-act-order": (gptq_quantizer(4, 16, desc_act=True, v2=False), 4, 1, 16),
    "gptq-8bit-v2": (gptq_quantizer(8, 40, desc_act=False, v2=True), 8, 0, 40),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_equals_dequantize_and_matmul(case, tokens, dtype):
    quantizer, bits, zero_offset, group = CASES[case]
    torch.manual_seed(0)
    weight = torch.randn(72, 80)  # N=72 and K=80: neither fills whole 32-wide tiles
    saved, dequantized = quantizer(weight)
    saved = {name: tensor.contiguous() for name, tensor in saved.items()}
    x = torch.randn(tokens, 80).to(dtype)
    is_awq = case.startswith("awq")
    g_idx = None if is_awq else saved["g_idx"]
    got = packed_matmul(
        x, saved["qweight"], saved["qzeros"], saved["scales"], g_idx, group, bits, zero_offset, is_awq
    )
    expected = x.float() @ dequantized.t()
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 10)


@pytest.mark.parametrize("fmt", ["awq", "gptq-4bit-act-order-v2"])
def test_layers_run_the_kernel_when_asked(fmt, tmp_path, monkeypatch):
    arch, method_cls, quantizer, config = FORMATS[fmt]
    src = make_tiny_checkpoint(arch, tmp_path)
    write_quantized(src, tmp_path / "q", quantizer, config)
    model = load_pagellm(tmp_path / "q", quant_method=method_cls(config))
    ids = list(range(3, 20))
    expected = PagedRunner(model, num_seqs=1).step({0: ids})[0]
    for layer in quantized_layers(model).values():
        assert not layer.triton_gemm  # CPU tensors: the torch path
        layer.triton_gemm = True
    calls = []
    module = awq if method_cls is awq.AwqMethod else gptq
    monkeypatch.setattr(module, "packed_matmul", lambda *a, **k: calls.append(1) or packed_matmul(*a, **k))
    got = PagedRunner(model, num_seqs=1).step({0: ids})[0]
    assert len(calls) == 8  # every quantized layer of the 2-layer model
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
