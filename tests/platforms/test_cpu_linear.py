"""The native panel linears (platforms/cpu_kernels/linear_panels.cpp and linear_bf16_pairs.cpp via
platforms/cpu_linear.py): bfloat16 weights on CPUs where oneDNN cannot pack them or AVX-512 BF16 multiplies
them faster, checked against F.linear in float32 on the same values; the platform's choice of each. (Its op under torch.compile: test_cpu.py's test_packed_linear_compiles.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.platforms import cpu, cpu_kernels, cpu_linear
from pagellm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels split their work across threads


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


@pytest.mark.parametrize(("out_features", "in_features"), [(16 * 37 + 5, 96), (16 * 9, 33), (16 * 40, 576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_reads_several_panels_at_once_and_sums_as_a_block_does(
    out_features, in_features, dtype, bias
):
    """One x row (a decode step) reads four panels at once per thread, from four places of its run, plus the
    run's remainder one at a time: each row's sums come out the bits a register block of two rows gives it."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(2, in_features, generator=gen).to(dtype)
    packed = cpu_linear.pack(weight)
    pair = packed.matmul(x, packed.weight, b)
    for row in range(2):
        alone = packed.matmul(x[row : row + 1], packed.weight, b)
        assert torch.equal(alone[0], pair[row])
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(
        pair.float(), expected, rtol=2**-8 if dtype == torch.bfloat16 else 1e-5, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_strided_x_and_a_bias_of_another_dtype(dtype):
    """x not contiguous (a transposed view) is read through a contiguous copy; a float16 bias is widened by
    ATen (bfloat16 and float32 ones are read in place)."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 100, generator=gen).to(dtype)
    bias = torch.randn(37, generator=gen).half()
    x = torch.randn(100, 3, generator=gen).to(dtype).t()
    assert not x.is_contiguous()
    packed = cpu_linear.pack(weight)
    out = packed.matmul(x, packed.weight, bias)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-5)


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
    monkeypatch.setattr(cpu, "_bf16_pair_kernels", lambda: None)
    monkeypatch.setattr(cpu, "onednn_packs", lambda dtype: False)
    packed = CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16())
    assert isinstance(packed.matmul, cpu_linear.PanelLinear) and packed.weight.dtype == torch.bfloat16
    assert packed.weight.shape == (2, 64, 16)  # two panels of 16 output columns, k-major
    assert CpuPlatform.pack_linear(torch.randn(15, 64).bfloat16()) is None  # narrower than a panel
    monkeypatch.setattr(cpu, "_kernels", lambda: None)  # no compiler: F.linear
    assert CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fixed_order_rows_do_not_depend_on_the_batch(dtype):
    """Batch-invariant mode: a row's result is the same bits alone, in blocks of two or three rows (two
    accumulator chains by default) and among 130 (chunks of 48, blocks of up to six)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 300, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(130, 300, generator=gen).to(dtype)
    fixed = cpu_linear.pack(weight, fixed_order=True)
    alone = torch.cat([fixed.matmul(x[i : i + 1], fixed.weight, bias) for i in range(len(x))])
    for rows in (2, 3, 7, 49, 130):
        assert torch.equal(fixed.matmul(x[:rows], fixed.weight, bias), alone[:rows]), rows
    torch.testing.assert_close(
        alone.float(), F.linear(x.float(), weight.float(), bias.float()), rtol=2**-8, atol=1e-4
    )
    if cpu_kernels.load().isa() == "scalar":
        return  # the plain C++ block has one chain per row anyway
    default = cpu_linear.pack(weight)
    in_pairs = torch.cat([default.matmul(x[i : i + 2], default.weight, bias) for i in range(0, 130, 2)])
    assert not torch.equal(in_pairs, fixed.matmul(x, fixed.weight, bias)), "the default order should differ"


def test_batch_invariant_packs_every_float_weight(monkeypatch):
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    for dtype in (torch.bfloat16, torch.float32):
        packed = CpuPlatform.pack_linear(torch.randn(3, 64).to(dtype), batch_invariant=True)  # a router
        assert isinstance(packed.matmul, cpu_linear.PanelLinear) and packed.matmul.fixed_order
    assert CpuPlatform.batch_invariant_unsupported(torch.bfloat16) is None
    assert "float16" in CpuPlatform.batch_invariant_unsupported(torch.float16)
    monkeypatch.setattr(cpu, "_kernels", lambda: None)
    assert "native CPU kernels" in CpuPlatform.batch_invariant_unsupported(torch.float32)


@pytest.mark.parametrize("rows", [1, 3, 8, 49, 130])
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_quantized_matches_the_dequantized_weight(rows, wdtype, dtype, bias):
    """int8 and e4m3 panels with a scale per output column (37: a padded last panel), against F.linear in
    float32 on the dequantized weight: the same products, summed in float32."""
    gen = torch.Generator().manual_seed(rows)
    real = torch.randn(37, 100, generator=gen)
    scale = real.abs().amax(dim=1, keepdim=True) / (127.0 if wdtype == torch.int8 else 448.0)
    q = (real / scale).round().clamp(-127, 127) if wdtype == torch.int8 else real / scale
    weight = q.to(wdtype)
    b = torch.randn(37, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 100, generator=gen).to(dtype)
    panels, packed_scale = cpu_linear.pack_quantized(weight, scale)
    assert panels.dtype == wdtype and packed_scale.shape == (48,)
    out = cpu_linear.quantized_linear(x, panels, packed_scale, b, 37)
    expected = F.linear(x.float(), weight.float() * scale, None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, 37)
    tolerance = dict(rtol=2**-8, atol=1e-4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_weight_only_one_row_sums_as_a_block_does(wdtype):
    """The one-row path reads quantized panels four at a time too: the same bits as a two-row block, scaled
    per column, the padded last panel included."""
    gen = torch.Generator().manual_seed(7)
    real = torch.randn(16 * 37 + 5, 96, generator=gen)
    scale = real.abs().amax(dim=1, keepdim=True) / (127.0 if wdtype == torch.int8 else 448.0)
    q = (real / scale).round().clamp(-127, 127) if wdtype == torch.int8 else real / scale
    panels, packed_scale = cpu_linear.pack_quantized(q.to(wdtype), scale)
    x = torch.randn(2, 96, generator=gen).bfloat16()
    b = torch.randn(real.shape[0], generator=gen).bfloat16()
    pair = cpu_linear.quantized_linear(x, panels, packed_scale, b, real.shape[0])
    for row in range(2):
        alone = cpu_linear.quantized_linear(x[row : row + 1], panels, packed_scale, b, real.shape[0])
        assert torch.equal(alone[0], pair[row])


def test_weight_only_per_tensor_scale_and_the_platform_choice():
    weight = torch.randint(-127, 128, (20, 64), dtype=torch.int8)
    panels, scale = cpu_linear.pack_quantized(weight, torch.tensor(0.5))  # AutoFP8's one value
    assert scale[:20].eq(0.5).all() and scale[20:].eq(0).all()
    assert cpu.pack_weight_only(weight, torch.ones(20, 1), torch.bfloat16) is not None
    assert cpu.pack_weight_only(weight, torch.ones(20, 1), torch.float16) is None  # x must be f32 or bf16
    assert cpu.pack_weight_only(weight.float(), torch.ones(20, 1), torch.bfloat16) is None


def test_weight_only_says_once_at_load_why_prefills_are_no_faster(caplog, monkeypatch):
    """The issue's rule: a quantized path slower than bf16 on this CPU says why at start-up. The panels
    halve the bytes but multiply in float32, so compute-bound steps (prefills) gain nothing."""
    cpu._explain_weight_only.cache_clear()
    weight = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    with caplog.at_level("INFO", logger="pagellm"):
        for _ in range(3):  # one line per dtype, not per layer
            assert cpu.pack_weight_only(weight, torch.ones(32, 1), torch.bfloat16) is not None
    lines = [r.getMessage() for r in caplog.records if "weight-only int8" in r.getMessage()]
    assert len(lines) == 1 and "half the bytes" in lines[0]
    assert ("AMX tiles" if cpu._amx_kernels() is not None else "float32 multiplies") in lines[0]
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: object())
    cpu._explain_weight_only.cache_clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="pagellm"):
        cpu.pack_weight_only(weight.view(torch.float8_e4m3fn), torch.ones(32, 1), torch.bfloat16)
    assert any(
        "weight-only float8_e4m3fn" in r.getMessage() and "AMX tiles" in r.getMessage()
        for r in caplog.records
    )
    cpu._explain_weight_only.cache_clear()


def test_pair_layout_puts_each_columns_input_pairs_side_by_side():
    """`pack_pairs` runs anywhere (torch only): panel p, pair i, column c holds W[16p + c, 2i : 2i + 2],
    zeros past N and K."""
    weight = torch.arange(37 * 7, dtype=torch.float32).reshape(37, 7).bfloat16()
    panels = cpu_linear.pack_pairs(weight).weight
    assert panels.shape == (3, 4, 16, 2) and panels.dtype == torch.bfloat16
    assert torch.equal(panels[1, 2, 5], weight[21, 4:6])
    assert torch.equal(panels[0, 3, 0], torch.tensor([weight[0, 6], 0]).bfloat16())  # K odd: a zero
    assert not panels[2, :, 5:].any()  # columns 37-47 are padding


def pair_kernels():
    if cpu._bf16_pair_kernels() is None:
        pytest.skip("no AVX-512 BF16 pair kernel here (CPU without AVX-512 BF16, or no compiler)")


# register blocks of 1-8 rows (1 and 2 with two more chains of sums), several blocks, one or two panels
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 21])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 101), (64, 48), (16, 1), (48, 6)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_kernel_matches_f_linear(rows, out_features, in_features, bias):
    pair_kernels()
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, in_features, generator=gen).bfloat16()[1]  # a view with an offset
    packed = cpu_linear.pack_pairs(weight)
    out = packed.matmul(x, packed.weight, b)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # float32 sums of the same products, one rounding at the end
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features"), [(16 * 37 + 5, 96), (16 * 9, 33), (16 * 40, 577)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_kernel_one_row_reads_four_panels_at_once_and_sums_as_a_block_does(
    out_features, in_features, bias
):
    """One x row reads four panels at once per thread, from four places of its run, plus the run's
    remainder one at a time: each row's sums come out the bits a register block of two rows gives it."""
    pair_kernels()
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, in_features, generator=gen).bfloat16()
    packed = cpu_linear.pack_pairs(weight)
    two = packed.matmul(x, packed.weight, b)
    for row in range(2):
        assert torch.equal(packed.matmul(x[row : row + 1], packed.weight, b)[0], two[row])
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(two.float(), expected, rtol=2**-8, atol=1e-4)


def test_pair_kernel_leading_dims_empty_input_and_wrong_inputs():
    pair_kernels()
    weight = torch.randn(20, 8).bfloat16()
    packed = cpu_linear.pack_pairs(weight)
    x = torch.randn(2, 3, 8).bfloat16()
    out = packed.matmul(x, packed.weight, None)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2**-8, atol=1e-5)
    assert packed.matmul(x[:, :0], packed.weight, None).shape == (2, 0, 20)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        packed.matmul(x.float(), packed.weight, None)
    with pytest.raises(RuntimeError, match="packed by platforms/cpu_linear.py for 20 x 10"):
        packed.matmul(torch.randn(3, 10).bfloat16(), packed.weight, None)


def test_bfloat16_weights_take_the_pair_kernel_where_avx512_bf16_runs_it(monkeypatch):
    """Ahead of oneDNN and the panel kernel, behind AMX; bfloat16 only, and not for a weight narrower than
    a panel."""
    pair_kernels()
    monkeypatch.setattr(cpu, "_amx_kernels", lambda: None)
    packed = CpuPlatform.pack_linear(torch.randn(32, 64).bfloat16())
    assert isinstance(packed.matmul, cpu_linear.PairLinear) and packed.weight.shape == (2, 32, 16, 2)
    assert not isinstance(getattr(CpuPlatform.pack_linear(torch.randn(15, 64).bfloat16()), "matmul", None),
                          cpu_linear.PairLinear)  # fmt: skip
    half = CpuPlatform.pack_linear(torch.randn(32, 64).half())
    assert half is None or not isinstance(half.matmul, cpu_linear.PairLinear)
    assert CpuPlatform.pack_linear(torch.randn(32, 64)) is None  # float32 on AVX-512: F.linear


# one row (each head's panels split into streams), a block of rows, several blocks; a padded last panel
@pytest.mark.parametrize("rows", [1, 3, 21])
@pytest.mark.parametrize(("heads", "out_features", "in_features"), [(4, 512, 128), (3, 40, 64)])
def test_per_head_products_equal_each_heads_own_matmul(rows, heads, out_features, in_features):
    """MLA's up-projections on the pair kernel (`CpuPlatform.pack_per_head`): every head's rows of a strided
    x (q_nope, a slice of each head's query) times that head's own weight, bit for bit what the pair kernel
    gives that head alone, and within one bfloat16 rounding of float32 products."""
    pair_kernels()
    gen = torch.Generator().manual_seed(rows + heads)
    weight = torch.randn(heads, out_features, in_features, generator=gen).bfloat16()
    q = torch.randn(rows, heads, in_features + 32, generator=gen).bfloat16()
    x = q[..., :in_features]  # strided over tokens and heads, contiguous within a head
    packed = CpuPlatform.pack_per_head(weight)
    out = packed.matmul(x, packed.weight, None)
    assert out.shape == (rows, heads, out_features) and out.dtype == torch.bfloat16
    for h in range(heads):
        alone = cpu_linear.pack_pairs(weight[h])
        assert torch.equal(out[:, h], alone.matmul(x[:, h].contiguous(), alone.weight, None))
    expected = torch.bmm(x.float().transpose(0, 1), weight.float().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-4)


def test_per_head_products_only_for_bfloat16_with_the_pair_kernel():
    pair_kernels()
    assert CpuPlatform.pack_per_head(torch.randn(2, 32, 16)) is None  # float32: torch.bmm
    assert CpuPlatform.pack_per_head(torch.randn(2, 32, 15).bfloat16()) is None  # an odd K
    assert CpuPlatform.pack_per_head(torch.randn(2, 8, 16).bfloat16()) is None  # narrower than a panel
