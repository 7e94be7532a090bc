"""Interpreter mode is scoped to the tests that ask for it (the `triton_interpreter` fixture), not set for the
whole process: each Triton kernel is jitted once per mode, and in a fresh process that imports triton and
pagellm with TRITON_INTERPRET unset and jits the kernels compiled first, as a session on a device does, the
kernels still run interpreted on CPU tensors under the fixture, and compiled again after it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagellm.attention_backends import triton_attn  # noqa: E402
from pagellm.platforms import triton_moe  # noqa: E402
from pagellm.quantization import packed_triton  # noqa: E402

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
SESSION_TEST = """
import os
import sys

assert "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules
sys.path[:0] = [{models!r}, {quantization!r}]

import torch
from quant_formats import gptq_quantizer
from triton.runtime.interpreter import InterpretedFunction

from pagellm.attention_backends import triton_attn
from pagellm.core.attention import AttentionSpec
from pagellm.core.moe import fused_experts_reference
from pagellm.platforms import triton_moe
from pagellm.quantization import packed_triton
from pagellm.testing.attention import check_backend


def test_kernels_jitted_for_a_device_first():
    assert not isinstance(triton_attn._kernel(), InterpretedFunction)
    packed_triton._kernel()
    triton_moe._kernel()


def test_the_kernels_run_interpreted_under_the_fixture(triton_interpreter):
    spec = AttentionSpec(8, 2, 64, torch.float32, block_size=16)
    assert check_backend(triton_attn.TritonAttnBackend, spec, "cpu", [([17, 5], [17, 1])]) < 1e-5
    torch.manual_seed(0)
    saved, dequantized = gptq_quantizer(4, 16, desc_act=True, v2=False)(torch.randn(40, 48))
    x = torch.randn(3, 48)
    got = packed_triton.packed_matmul(
        x, saved["qweight"], saved["qzeros"], saved["scales"], saved["g_idx"], 16, 4, 1, False
    )
    torch.testing.assert_close(got, x @ dequantized.t(), rtol=1e-4, atol=1e-3)
    w13, w2 = torch.randn(4, 32, 24) / 5, torch.randn(4, 24, 16) / 4
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 2], [2, 3], [1, 0]])
    got = triton_moe.fused_experts_triton(x[:, :24], w13, w2, weights, ids)
    want = fused_experts_reference(x[:, :24], w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_compiled_again_after_the_fixture():
    assert "TRITON_INTERPRET" not in os.environ
    assert not isinstance(triton_attn._kernel(), InterpretedFunction)
    assert not isinstance(triton_moe._kernel(), InterpretedFunction)
"""


def kernels() -> list:
    return [triton_attn._kernel(), packed_triton._kernel(), triton_moe._kernel()]


def test_one_kernel_per_mode(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = kernels()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = kernels()
    assert isinstance(interpreted[0], InterpretedFunction)
    assert all(a is not b for a, b in zip(compiled, interpreted, strict=True))
    assert all(a is b for a, b in zip(interpreted, kernels(), strict=True))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert all(a is b for a, b in zip(compiled, kernels(), strict=True))


@pytest.mark.slow  # a fresh process: about 5 s, most of it importing torch
def test_interpreter_mode_lasts_only_as_long_as_the_fixture(pytester, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(
        SESSION_TEST.format(models=str(TESTS / "models"), quantization=str(TESTS / "quantization"))
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
