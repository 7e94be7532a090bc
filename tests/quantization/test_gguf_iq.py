"""The i-quants on lattice codebooks (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) read in place by
the CPU kernels (`cpu_kernels/gguf_blocks.h`, `iq_group`): dequantization equal to gguf-py's bit for bit,
the linear's products against x times the dequantized weights (float32 x as it is, bfloat16 x quantized to
int8 groups of 32 as the kernel does) for 1, 3 and 9 rows (the one-row path, a few rows straight from the
blocks, the tiles), the experts kernel, and a model whose layers stay the file's bytes.

gguf-py cannot quantize to these types, so the blocks are random: every index, sign and scale pattern is a
valid block once its float16 scale is finite; gguf-py's dequantization is the oracle."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

TESTS = Path(__file__).parents[1]
sys.path[:0] = [
    str(TESTS / "models"),
    str(TESTS / "platforms"),
    str(TESTS / "engine"),
    str(Path(__file__).parent),
]
from models_harness import load_pagellm  # noqa: E402
from quant_formats import plain_linear_bytes, quantized_layers, quantized_linear_bytes, write_quantized  # noqa: E402
from test_cpu_gguf import TILES, quantized_x  # noqa: E402
from test_cpu_gguf_moe import magnitude, reference, routing  # noqa: E402
from test_gguf_moe_experts import WIDE as MOE_WIDE  # noqa: E402
from test_gguf_moe_experts import check_packed_tokens  # noqa: E402
from tiny import make_tiny_checkpoint  # noqa: E402

from pagellm.bench.gguf_convert import convert_hf_checkpoint, reencode_gguf  # noqa: E402
from pagellm.platforms import cpu_gguf, cpu_gguf_moe  # noqa: E402
from pagellm.quantization.gguf import GgufMethod  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")

IQ_TYPES = [T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M]


def iq_blocks(ggml_type: T, rows: int, columns: int, seed: int = 0, scale: float = 0.002) -> np.ndarray:
    """uint8 [rows, bytes per row] of random `ggml_type` blocks: random bytes, the float16 d normal times
    `scale` (IQ1_M's d is the top nibbles of its four scale words, the words' other bits kept random)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    d = (rng.standard_normal((rows, columns // block)) * scale).astype(np.float16).view(np.uint16)
    if ggml_type == T.IQ1_M:
        words = raw[..., 48:56].copy().view(np.uint16)  # [rows, blocks, 4]
        for j in range(4):  # word j's top nibble is d's bits 4 j .. 4 j + 3
            words[..., j] = (words[..., j] & 0x0FFF) | (((d >> (4 * j)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8)
    else:
        raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def oracle(raw: np.ndarray, ggml_type: T) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, ggml_type)).double()


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_the_types_are_kernel_types(ggml_type):
    assert int(ggml_type) in cpu_gguf.KERNEL_TYPES and cpu_gguf.has_kernel(int(ggml_type))


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_for_bit_gguf_py(ggml_type):
    raw = iq_blocks(ggml_type, 12, 1024, seed=1)
    expected = quants.dequantize(raw, ggml_type).astype(np.float32)
    got = cpu_gguf.dequantize(torch.from_numpy(raw), int(ggml_type)).numpy()
    assert got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([[5, 0], [11, 5]])  # a token embedding kept in these blocks: the rows looked up
    rows = cpu_gguf.embedding(ids, torch.from_numpy(raw), int(ggml_type), torch.float32)
    assert torch.equal(rows, torch.from_numpy(expected)[ids])


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_float32_rows_equal_x_times_dequantized_weights(ggml_type, rows, two_threads):
    raw = iq_blocks(ggml_type, 40, 512, seed=rows)
    weight = oracle(raw, ggml_type)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1))
    got = cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(ggml_type)])
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    magnitude_ = x.double().abs() @ weight.abs().T
    assert ((got.double() - x.double() @ weight.T).abs() <= 1e-5 * magnitude_).all()


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_bfloat16_rows_equal_int8_x_times_dequantized_weights(ggml_type, rows, two_threads):
    # one row and three straight from the blocks, nine in tiles of eight (a partial last tile); 43 weight
    # rows: the two threads' runs of odd lengths, a last weight row without a pair
    raw = iq_blocks(ggml_type, 43, 512, seed=rows)
    weight = oracle(raw, ggml_type)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(ggml_type)])
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 43)
    xq = quantized_x(x.float())
    expected = xq @ weight.T
    # the kernel's float32 sums, then bfloat16's rounding of the result
    assert (
        (got.double() - expected).abs() <= 1e-5 * (xq.abs() @ weight.abs().T) + expected.abs() / 128
    ).all()
    exact = x.double() @ weight.T
    relative = (got.double() - exact).norm() / exact.norm()
    assert relative < 0.02, f"{ggml_type.name}: {relative:.4f} relative error from quantizing x"


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_a_prefill_chunk_and_many_float32_rows(ggml_type, two_threads):
    """130 bfloat16 rows of K = 4864 (the tiles, a few per pass over the weight rows) and 40 float32 rows
    (slabs of dequantized rows through torch's GEMM)."""
    raw = iq_blocks(ggml_type, 37, 4864, seed=5)
    weight = oracle(raw, ggml_type)
    x = torch.randn(130, 4864, generator=torch.Generator().manual_seed(6)).bfloat16()
    got = cpu_gguf.linear(x, [torch.from_numpy(raw)], [int(ggml_type)])
    xq = quantized_x(x.float()) if TILES else x.double()
    expected = xq @ weight.T
    assert (
        (got.double() - expected).abs() <= 1e-5 * (xq.abs() @ weight.abs().T) + expected.abs() / 128
    ).all()
    xf = x[:40].float()
    got = cpu_gguf.linear(xf, [torch.from_numpy(raw)], [int(ggml_type)])
    bound = 1e-5 * (xf.double().abs() @ weight.abs().T)
    assert ((got.double() - xf.double() @ weight.T).abs() <= bound).all()


EXPERTS, HIDDEN, INTER = 4, 256, 256


def stacked(ggml_type: T, rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = [iq_blocks(ggml_type, rows, columns, seed=seed * EXPERTS + e, scale=0.02) for e in range(EXPERTS)]
    return torch.stack([torch.from_numpy(r) for r in raw]), torch.stack([oracle(r, ggml_type) for r in raw])


@pytest.mark.parametrize("types", [IQ_TYPES[0:3], IQ_TYPES[3:6], [T.IQ1_M, T.IQ3_S, T.IQ2_XS]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7])
def test_experts_equal_the_dequantized_experts(types, dtype, tokens, two_threads):
    """The experts kernel on gate/up/down stacks of these types, kept as given (`cpu_gguf_moe.pack`)."""
    (gate_raw, gate), (up_raw, up), (down_raw, down) = (
        stacked(types[0], INTER, HIDDEN, 0),
        stacked(types[1], INTER, HIDDEN, 1),
        stacked(types[2], HIDDEN, INTER, 2),
    )
    assert cpu_gguf_moe.runs([int(t) for t in types])
    kernel = cpu_gguf_moe.pack(gate_raw, up_raw, down_raw, [int(t) for t in types], "silu", "")
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    weights, ids = routing(tokens, 2, 4)
    got = kernel(x, weights, ids).double()
    as_kernel = torch.Tensor.double if dtype == torch.float32 else quantized_x
    expected, steps = reference(x, weights, ids, gate, up, down, as_kernel)
    bound = 1e-5 * magnitude(x, weights, ids, gate, up, down) + steps
    if dtype == torch.bfloat16:
        bound = bound + expected.abs() / 128
    assert ((got - expected).abs() <= bound).all()


WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def test_a_model_of_i_quants_stays_the_files_bytes(tmp_path):
    """A tiny Llama whose linears are these types, the next type for each weight: every layer on the kernel,
    its weights the file's bytes, multiplying as the dequantized weights."""
    src = make_tiny_checkpoint("llama", tmp_path, **WIDE)
    types = iter(IQ_TYPES * 8)

    def quantize(weight: torch.Tensor):
        ggml_type = next(types)
        raw = iq_blocks(ggml_type, weight.shape[0], weight.shape[1], seed=weight.numel() % 97)
        saved = {"qweight": torch.from_numpy(raw), "qweight_type": torch.tensor(int(ggml_type))}
        return saved, torch.from_numpy(quants.dequantize(raw, ggml_type))

    dequantized = write_quantized(src, tmp_path / "q", quantize, {"quant_method": "gguf"})
    model = load_pagellm(tmp_path / "q", quant_method=GgufMethod())
    plain = load_pagellm(src, torch.bfloat16)  # bfloat16's two bytes a weight
    reference = load_pagellm(dequantized)
    layers = quantized_layers(model)
    assert {t for layer in layers.values() for t in layer.qweight_types} == {int(t) for t in IQ_TYPES}
    # the file's bytes: 50 (IQ1_S) to 110 (IQ3_S) bytes per 256 weights, against bfloat16's 512
    file_bytes = sum(
        layer.in_features // 256 * GGML_QUANT_SIZES[T(t)][1] * rows
        for layer in layers.values()
        for t, rows in zip(layer.qweight_types, layer.output_sizes, strict=True)
    )
    assert quantized_linear_bytes(model) == file_bytes
    assert quantized_linear_bytes(model) < 0.25 * plain_linear_bytes(plain)
    for name, layer in layers.items():
        assert layer.gguf_paths == ["kernel"] * len(layer.output_sizes), name
        got = layer.quant_method.apply(layer, torch.eye(layer.in_features)).t()
        assert torch.equal(got, reference.get_submodule(name).weight), name


@pytest.mark.parametrize(
    "types",
    [(T.IQ2_XS, T.IQ3_XXS, T.IQ1_M), (T.IQ3_S, T.IQ2_S, T.IQ2_XXS), (T.IQ1_S, T.IQ1_S, T.IQ3_XXS)],
    ids=str,
)
def test_a_gguf_file_of_i_quant_experts_stays_packed(types, tmp_path):
    """A tiny Qwen3-MoE GGUF whose stacked experts (gate, up, down) are these types: on the experts kernel,
    the file's expert bytes, the greedy tokens of the same file with its experts dequantized at load."""
    from parity import GGUF_FAMILIES

    kinds = dict(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types, strict=True))

    def encode(name: str, values: np.ndarray):
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if kind not in kinds:
            return None
        experts, rows, columns = values.shape
        raw = iq_blocks(kinds[kind], experts * rows, columns, seed=len(name))
        return raw.reshape(experts, rows, -1), kinds[kind]

    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path, **GGUF_FAMILIES["qwen3_moe"], **MOE_WIDE)
    f32 = convert_hf_checkpoint(checkpoint, tmp_path / "tiny.f32.gguf", "float32")
    check_packed_tokens(reencode_gguf(f32, tmp_path / "tiny.experts.gguf", "float32", encode))
