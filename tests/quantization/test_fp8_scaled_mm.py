"""fp8's torch._scaled_mm path as a CUDA device would run it, on CPU tensors: the device's compute capability
is faked and torch._scaled_mm replaced by a strict stand-in that first holds the arguments to CUDA's rules
(torch's own checks, which meta tensors get, plus what only the CUDA kernels enforce) and then computes
the product with torch's real CPU kernel, so the numbers are checked too."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagellm.quantization import fp8
from pagellm.quantization.fp8 import FP8, ROWWISE, TENSORWISE, Fp8Method

REAL_SCALED_MM = torch._scaled_mm


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class StrictScaledMM:
    """torch._scaled_mm on a CUDA device of `capability`: refuses what the device would refuse."""

    def __init__(self, capability: tuple[int, int]):
        self.capability = capability
        self.calls: list[dict] = []

    def __call__(
        self, a, b, *, scale_a, scale_b, out_dtype, bias=None, scale_result=None, use_fast_accum=False
    ):
        # torch's shape, layout and scale checks; a meta tensor is checked by the CUDA rules
        REAL_SCALED_MM(
            _meta(a), _meta(b), scale_a=_meta(scale_a), scale_b=_meta(scale_b), out_dtype=out_dtype
        )
        m, n = a.shape[0], b.shape[1]
        assert a.dtype == b.dtype == FP8
        assert m % 16 == 0, f"cuBLASLt's FP8 GEMM wants M divisible by 16, got {m}"
        if scale_a.numel() == 1 and scale_b.numel() == 1:
            scheme = TENSORWISE
            assert self.capability >= (8, 9), "FP8 needs compute capability 8.9"
            assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        else:
            scheme = ROWWISE
            assert self.capability >= (9, 0), "row-wise scaling needs compute capability 9.0"
            assert out_dtype == torch.bfloat16, "row-wise scaling writes bfloat16 only"
            assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
        assert bias is None and scale_result is None
        self.calls.append({"scheme": scheme, "m": m})
        return REAL_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


@pytest.fixture
def cuda_like(monkeypatch):
    """Fake a CUDA device of the given capability for CPU tensors; returns the strict _scaled_mm."""

    def fake(capability):
        strict = StrictScaledMM(capability)
        monkeypatch.setattr(fp8, "_cuda_capability", lambda device: capability)
        monkeypatch.setattr(torch, "_scaled_mm", strict)
        fp8._scheme_works.cache_clear()
        return strict

    yield fake
    fp8._scheme_works.cache_clear()


def _layer(out_features=48, in_features=64, per_tensor=False) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Module()
    weight = torch.randn(out_features, in_features)
    if per_tensor:
        scale = torch.full((out_features, 1), float(weight.abs().max()) / fp8.FP8_MAX)
        layer.weight = (weight / scale).to(FP8)
    else:
        layer.weight, scale = Fp8Method.quantize(weight)
    layer.weight_scale = scale
    Fp8Method().process_weights_after_loading(layer)
    return layer


def _exact(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return x.float() @ (layer.weight.float() * layer.weight_scale).t()


@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (16, 64), (2, 17, 64)])
def test_rowwise_on_hopper_meets_cuda_rules_and_matches(cuda_like, shape):
    strict = cuda_like((9, 0))
    layer = _layer()
    assert layer.fp8_scaled_mm == ROWWISE
    x = torch.randn(*shape, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    got = Fp8Method().apply(layer, x, bias)
    assert got.shape == (*shape[:-1], 48) and got.dtype == torch.bfloat16
    exact = _exact(x, layer) + bias.float()
    assert (got.float() - exact).abs().max() < 0.06 * exact.abs().max()
    rows = x.numel() // 64
    assert strict.calls[-1] == {"scheme": ROWWISE, "m": -(-rows // 16) * 16}  # padded up to 16 rows


def test_rowwise_needs_bfloat16_activations(cuda_like):
    strict = cuda_like((9, 0))
    layer = _layer()
    calls = len(strict.calls)  # the load-time probe
    x = torch.randn(3, 64, dtype=torch.float16)
    torch.testing.assert_close(Fp8Method().apply(layer, x), _exact(x, layer).half(), rtol=2e-2, atol=2e-2)
    assert len(strict.calls) == calls  # dequantized


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_tensorwise_on_ada_for_a_per_tensor_checkpoint(cuda_like, dtype):
    strict = cuda_like((8, 9))
    layer = _layer(per_tensor=True)
    assert layer.fp8_scaled_mm == TENSORWISE
    x = torch.randn(7, 64, dtype=dtype)
    got = Fp8Method().apply(layer, x)
    exact = _exact(x, layer)
    assert got.dtype == dtype and (got.float() - exact).abs().max() < 0.08 * exact.abs().max()
    assert strict.calls[-1] == {"scheme": TENSORWISE, "m": 16}


def test_devices_and_shapes_that_cannot_dequantize(cuda_like):
    cuda_like((8, 9))
    assert _layer().fp8_scaled_mm is None  # per-channel scales need row-wise, which Ada lacks
    cuda_like((8, 6))
    assert _layer(per_tensor=True).fp8_scaled_mm is None  # no FP8 tensor cores
    cuda_like((9, 0))
    assert _layer(out_features=40).fp8_scaled_mm is None  # N not a multiple of 16
    assert _layer(in_features=72).fp8_scaled_mm is None  # K not a multiple of 16
    weight = torch.ones(64, 48).to(FP8).t()  # [48, 64] but not contiguous: its .t() is not column-major
    assert fp8._scaled_mm_runs(weight) is None


def test_a_kernel_missing_at_load_falls_back_to_dequantizing(cuda_like, monkeypatch, caplog):
    cuda_like((12, 0))

    def missing(*args, **kwargs):
        raise RuntimeError("no row-wise kernel for this architecture")

    monkeypatch.setattr(torch, "_scaled_mm", missing)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        layer = _layer()
    assert layer.fp8_scaled_mm is None
    assert "torch._scaled_mm (rowwise) fails on cpu, dequantizing instead" in caplog.text
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(Fp8Method().apply(layer, x).float(), _exact(x, layer), rtol=2e-2, atol=5e-2)


def test_cpu_tensors_take_the_dequantize_path():
    layer = _layer()
    assert layer.fp8_scaled_mm is None
