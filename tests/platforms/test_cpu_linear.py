"""The native panel linear (platforms/cpu_kernels/linear_panels.cpp via platforms/cpu_linear.py): bfloat16
weights on CPUs where oneDNN cannot pack them, checked against F.linear in float32 on the same values; the
platform's choice of it. (Its op under torch.compile: test_cpu.py's test_packed_linear_compiles.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.platforms import cpu, cpu_kernels, cpu_linear
from pagellm.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module", autouse=True)
def kernels():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.why_unavailable()}")
    return module


@pytest.mark.parametrize("rows", [1, 5, 8, 49, 130])  # register blocks of 1-6 rows, two chunks of 48 rows
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 100), (64, 48), (17, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, out_features, in_features, dtype, bias):
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(2, rows, in_features, generator=gen).to(dtype)[1]  # a view with an offset
    packed = cpu_linear.pack(weight)
    out = packed.matmul(x, packed.weight, b)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, out_features)
    if dtype == torch.bfloat16:  # float32 sums of the same products, one rounding at the end
        torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-5)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_empty_input():
    weight = torch.randn(20, 8).bfloat16()
    packed = cpu_linear.pack(weight)
    x = torch.randn(2, 3, 8).bfloat16()
    out = packed.matmul(x, packed.weight, None)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2**-8, atol=1e-5)
    assert packed.matmul(x[:, :0], packed.weight, None).shape == (2, 0, 20)


def test_bfloat16_weights_take_it_where_onednn_cannot_pack_them(monkeypatch):
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    monkeypatch.setattr(cpu, "onednn_packs", lambda dtype: False)
    packed = CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16())
    assert isinstance(packed.matmul, cpu_linear.PanelLinear) and packed.weight.dtype == torch.bfloat16
    assert packed.weight.shape == (2, 64, 16)  # two panels of 16 output columns, k-major
    assert CpuPlatform.pack_linear(torch.randn(15, 64).bfloat16()) is None  # narrower than a panel
    monkeypatch.setattr(cpu, "_kernels", lambda: None)  # no compiler: F.linear
    assert CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16()) is None
