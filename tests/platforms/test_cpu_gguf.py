"""The GGUF block kernels (`cpu_kernels/gguf_linear.cpp`): dequantization equals gguf-py's bit for bit for
every type, and the in-place linear equals x times the dequantized weights to float32 rounding (float32 x),
or x quantized to int8 in groups of 32, as the kernel does, times them (bfloat16 x), for one row and for
many, for fused parts of mixed types."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from pagellm.platforms import cpu_gguf, cpu_kernels

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
from quant_formats import random_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")

KERNEL_TYPES = [
    *(T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K),
    *(T.IQ4_NL, T.IQ4_XS, T.MXFP4),
]
DEQUANT_ONLY = [T.F32, T.F16, T.BF16]
INTERLEAVED_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.IQ4_NL]
# every kernel type as the file has it, and the 32-weight block types interleaved as the loader keeps them
LAYOUTS = [(t, "file") for t in KERNEL_TYPES] + [(t, "interleaved") for t in INTERLEAVED_TYPES]


# bfloat16 x from five rows takes the int8 tiles where they are built (AVX2); the plain C++ build multiplies
# from 32 rows dequantized slabs with x in float32, as it is
TILES = cpu_gguf.available() and cpu_kernels.load().isa() != "scalar"


def layout_id(case) -> str:
    return case.name if isinstance(case, T) else case


def kernel_weight(raw: np.ndarray, ggml_type: T, layout: str) -> tuple[torch.Tensor, int]:
    """The blocks as the kernel is given them: the file's, or interleaved (`cpu_gguf.interleave`)."""
    tensor = torch.from_numpy(raw)
    if layout == "file":
        return tensor, int(ggml_type)
    interleaved, type_id = cpu_gguf.interleave(tensor, int(ggml_type))
    assert type_id == cpu_gguf.INTERLEAVED + int(ggml_type) and interleaved.shape == tensor.shape
    return interleaved, type_id


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES + DEQUANT_ONLY, ids=lambda t: t.name)
def test_dequantize_is_bit_for_bit_gguf_py(ggml_type):
    raw = random_blocks(ggml_type, 12, 512)
    expected = quants.dequantize(raw, ggml_type)
    got = cpu_gguf.dequantize(torch.from_numpy(raw), int(ggml_type)).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 codes in groups of 32 times max|x| / 127, in float64. The codes are
    x * (127 / max|x|) rounded half to even, each operation in float32 as the kernel does it (numpy's: torch's
    `127 / tensor` is not the correctly rounded quotient, and moved a product at a tie to the other code)."""
    groups = x.float().numpy().reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.rint(groups * inv).astype(np.float64)
    scale = (amax / np.float32(127)).astype(np.float64)
    return torch.from_numpy(codes * scale).reshape(x.shape)


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 7])
def test_float32_rows_equal_x_times_dequantized_weights(ggml_type, layout, rows, two_threads):
    raw = random_blocks(ggml_type, 40, 512, seed=rows)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1))
    weight_blocks, type_id = kernel_weight(raw, ggml_type, layout)
    got = cpu_gguf.linear(x, [weight_blocks], [type_id])
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got.double() - x.double() @ weight.T).abs() <= 1e-5 * magnitude).all()


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 31])
def test_bfloat16_rows_equal_int8_x_times_dequantized_weights(ggml_type, layout, rows, two_threads):
    # up to four rows straight from the blocks, from five tiles of eight x rows (5, 9, 17, 31: partial last
    # tiles); 43 weight rows: the two threads' runs of rows of odd lengths, a last weight row without a pair
    raw = random_blocks(ggml_type, 43, 512, seed=rows)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    weight_blocks, type_id = kernel_weight(raw, ggml_type, layout)
    got = cpu_gguf.linear(x, [weight_blocks], [type_id])
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 43)
    expected = quantized_x(x.float()) @ weight.T
    magnitude = quantized_x(x.float()).abs() @ weight.abs().T
    # the kernel's float32 sums, then bfloat16's rounding of the result
    assert ((got.double() - expected).abs() <= 1e-5 * magnitude + expected.abs() / 128).all()
    # against unquantized x: the activations' rounding, the cost the kernel takes for integer products
    exact = x.double() @ weight.T
    relative = (got.double() - exact).norm() / exact.norm()
    assert relative < 0.02, f"{ggml_type.name}: {relative:.4f} relative error from quantizing x"


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
def test_many_float32_rows_multiply_the_dequantized_weights(ggml_type, layout, two_threads):
    """From 32 float32 rows the weights are dequantized a slab at a time for a float32 GEMM: x times the
    dequantized weights to float32 rounding; 300 rows span two slabs."""
    raw = random_blocks(ggml_type, 300, 512, seed=3)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4))
    weight_blocks, type_id = kernel_weight(raw, ggml_type, layout)
    got = cpu_gguf.linear(x, [weight_blocks], [type_id])
    assert got.dtype == torch.float32 and got.shape == (40, 300)
    expected = x.double() @ weight.T
    assert ((got.double() - expected).abs() <= 1e-5 * (x.double().abs() @ weight.abs().T)).all()


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
def test_a_prefill_chunk_of_bfloat16_rows(ggml_type, layout, two_threads):
    """A prefill chunk's bfloat16 rows take the int8 tiles as a batch does: 130 rows (seventeen tiles, the
    last of two rows) of K = 4864, whose x codes are taken a few tiles per pass over the weight rows."""
    raw = random_blocks(ggml_type, 37, 4864, seed=5)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type)).double()
    x = torch.randn(130, 4864, generator=torch.Generator().manual_seed(6)).bfloat16()
    weight_blocks, type_id = kernel_weight(raw, ggml_type, layout)
    got = cpu_gguf.linear(x, [weight_blocks], [type_id])
    assert got.dtype == torch.bfloat16 and got.shape == (130, 37)
    xq = quantized_x(x.float()) if TILES else x.double()
    expected = xq @ weight.T
    assert (
        (got.double() - expected).abs() <= 1e-5 * (xq.abs() @ weight.abs().T) + expected.abs() / 128
    ).all()


@pytest.mark.parametrize("ggml_type", INTERLEAVED_TYPES, ids=lambda t: t.name)
def test_interleaving_keeps_the_bytes_and_the_values(ggml_type, two_threads):
    """Four blocks at a time rewritten: as many bytes, other bytes, the same weights (dequantized bit for bit
    as gguf-py does the file's), the same float32 products in the same order; an expert stack [E, N, bytes]
    interleaved as its rows are."""
    raw = random_blocks(ggml_type, 24, 1024, seed=7)
    interleaved, type_id = kernel_weight(raw, ggml_type, "interleaved")
    assert not torch.equal(interleaved, torch.from_numpy(raw))
    assert cpu_gguf.has_kernel(type_id) and cpu_gguf.type_name(type_id) == f"{ggml_type.name} (interleaved)"
    expected = quants.dequantize(raw, ggml_type).astype(np.float32)
    got = cpu_gguf.dequantize(interleaved, type_id).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(8))
    assert torch.equal(
        cpu_gguf.linear(x, [interleaved], [type_id]),
        cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(ggml_type)]),
    )
    ids = torch.tensor([[5, 0], [23, 5]])  # an interleaved token embedding's rows, as the file's dequantized
    assert torch.equal(
        cpu_gguf.embedding(ids, interleaved, type_id, torch.float32), torch.from_numpy(expected)[ids]
    )
    stack, stack_type = cpu_gguf.interleave(torch.from_numpy(raw).view(2, 12, -1), int(ggml_type))
    assert stack_type == type_id and torch.equal(stack.view(24, -1), interleaved)


def test_rows_of_partial_super_blocks_and_k_quants_stay_as_the_file_has_them():
    raw = torch.from_numpy(random_blocks(T.Q5_0, 8, 576))  # 18 blocks a row (model S's width)
    same, type_id = cpu_gguf.interleave(raw, int(T.Q5_0))
    assert same is raw and type_id == int(T.Q5_0)
    k_quant = torch.from_numpy(random_blocks(T.Q4_K, 8, 512))
    assert cpu_gguf.interleave(k_quant, int(T.Q4_K)) == (k_quant, int(T.Q4_K))


def test_fused_parts_of_mixed_types_and_bfloat16_rows(two_threads):
    in_features = 256
    types = [T.Q4_K, T.Q8_0, T.Q6_K]
    raws = [
        random_blocks(t, n, in_features, seed=i)
        for i, (t, n) in enumerate(zip(types, [32, 8, 24], strict=True))
    ]
    x = torch.randn(2, 3, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = cpu_gguf.linear(x, [torch.from_numpy(r) for r in raws], [int(t) for t in types])
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 64)
    for raw, t, lo, hi in zip(raws, types, [0, 32, 40], [32, 40, 64], strict=True):
        alone = cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(t)])
        assert torch.equal(got[..., lo:hi], alone)


def test_a_type_without_kernel_is_refused():
    raw = random_blocks(T.TQ2_0, 4, 256)
    with pytest.raises(RuntimeError, match="has no kernel"):
        cpu_gguf.linear(torch.randn(1, 256), [torch.from_numpy(raw)], [int(T.TQ2_0)])
    assert not cpu_gguf.has_kernel(int(T.TQ2_0)) and cpu_gguf.has_kernel(int(T.Q2_K))


def test_the_gguf_loader_widens_block_tensors_with_the_loaded_kernels(monkeypatch):
    """The GGUF loader's dequantize (models/gguf_checkpoint.py) goes through the kernels once they are loaded,
    with gguf-py's bits; float tensors stay on gguf-py's code."""
    from pagellm.models.gguf_checkpoint import _dequantize
    from pagellm.platforms import cpu_kernels

    kernels = cpu_kernels.loaded()
    calls = []
    original = kernels.gguf_dequantize
    monkeypatch.setattr(kernels, "gguf_dequantize", lambda raw, t: calls.append(t) or original(raw, t))
    for ggml_type in (T.Q4_K, T.Q6_K, T.Q8_0):
        raw = random_blocks(ggml_type, 16, 512)
        got = _dequantize(raw, ggml_type)
        assert np.array_equal(got.view(np.uint32), quants.dequantize(raw, ggml_type).view(np.uint32))
    assert calls == [T.Q4_K, T.Q6_K, T.Q8_0]
    floats = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    assert np.array_equal(_dequantize(floats, T.F32), floats) and len(calls) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_x_codes_round_half_to_even_as_the_reference(dtype):
    """x values whose scaled product lands exactly halfway between two codes (max |x| 127: a scale of 1):
    every path quantizes them to the even code, as `quantized_x`; a round-half-away quantization of x gives
    another sum. (bfloat16 x is quantized to int8 groups; float32 x keeps its values, the check of the
    float path.)"""
    halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, -3.5] + [0.0] * 22)
    x = torch.cat([halves, halves.roll(16)]).repeat(4)[None].to(dtype)  # eight groups, both halves tied
    ones = np.tile(np.where(np.abs(x.float().numpy()) < 100, 1.0, 0.0), (8, 1)).astype(np.float32)
    raw = quants.quantize(ones, T.Q8_0)
    got = cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(T.Q8_0)]).double()
    reference = quantized_x(x.float()) if dtype == torch.bfloat16 else x.double()
    expected = reference @ torch.from_numpy(quants.dequantize(raw, T.Q8_0)).double().T
    assert torch.equal(got, expected.to(dtype).double()), (got[0, :2], expected[0, :2])


def test_the_first_weight_on_the_kernel_says_which_instructions_multiply(caplog, monkeypatch):
    monkeypatch.setattr(cpu_gguf, "_said", [])
    raw = torch.from_numpy(random_blocks(T.Q4_0, 8, 256, seed=0))
    with caplog.at_level(logging.INFO, logger="pagellm"):
        cpu_gguf.interleave(raw, int(T.Q4_0))
        cpu_gguf.interleave(raw, int(T.Q4_0))
    said = [r.getMessage() for r in caplog.records if "native CPU kernel" in r.getMessage()]
    assert len(said) == 1 and f"({cpu_kernels.load().gguf_isa()}" in said[0], said


def test_decode_rows_are_prefetched_by_software_on_intel_only():
    """Intel's AMX Xeon read a decode step's rows 1.2-1.4x faster with the next rows asked for ahead; AMD's
    Zen 4 up to half as fast (gguf_blocks.h, `rows_asked_ahead`): the choice follows the CPU's vendor."""
    vendors = {
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("vendor_id")
    }
    assert len(vendors) <= 1, vendors  # none on CPUs other than x86, whose build never prefetches rows
    assert cpu_kernels.load().gguf_rows_asked_ahead() == (vendors == {"GenuineIntel"})
