"""The GGUF experts kernel (`cpu_kernels/gguf_moe.cpp`) against the dequantized reference: gguf-py's
dequantized experts run by `fused_experts_reference`'s arithmetic in float64, with x (and the activations)
as the kernel sees them: float32 as they are, bfloat16 quantized to int8 groups of 32. Every kernel type,
one token (decode: each expert's one-row path) and several (experts shared by several tokens: tiles of
eight x rows for bfloat16, the row products or slabs for float32), top-k > 1, a layer with a type per
projection as llama.cpp's Q4_K_M files mix them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from pagellm.core import moe
from pagellm.platforms import cpu_gguf, cpu_gguf_moe

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
sys.path.insert(0, str(Path(__file__).parent))
from quant_formats import random_blocks  # noqa: E402
from test_cpu_gguf import LAYOUTS, TILES, layout_id, quantized_x  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")

EXPERTS, HIDDEN, INTER = 4, 256, 256


def stacked(ggml_type, rows: int, columns: int, seed: int):
    """E experts' random blocks uint8 [E, rows, bytes] and their dequantized float64 [E, rows, columns]."""
    raw = [
        random_blocks(ggml_type, rows, columns, seed=seed * EXPERTS + e, scale=0.05) for e in range(EXPERTS)
    ]
    values = [torch.from_numpy(quants.dequantize(r, ggml_type)).double() for r in raw]
    return torch.stack([torch.from_numpy(r) for r in raw]), torch.stack(values)


def routing(tokens: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def reference(x, weights, ids, gate, up, down, as_kernel):
    """sum_k w * down(silu(gate x) * up x) in float64, x and the activations through `as_kernel` first; and
    what the activations' int8 rounding may move (float32 sums a hair apart may round a code the other way:
    one code step, max|group| / 127, per element), zero where `as_kernel` keeps them as they are."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    steps = torch.zeros_like(out)
    xs = as_kernel(x.float())
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            act = F.silu(gate[e] @ xs[t]) * (up[e] @ xs[t])
            out[t] += w * (down[e] @ as_kernel(act.float()))
            if as_kernel is quantized_x:
                step = act.abs().reshape(-1, 32).amax(-1, keepdim=True).expand(-1, 32).reshape(-1) / 127
                steps[t] += w * (down[e].abs() @ step)
    return out, steps


def magnitude(x, weights, ids, gate, up, down):
    """What the kernel's float32 rounding is relative to: the sums over absolute values, carried through the
    activation's derivatives (silu(g) u moves by about |u| dg + |g| du)."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            g, u = gate[e] @ xt, up[e] @ xt
            act = (
                (F.silu(g) * u).abs()
                + 1.1 * u.abs() * (gate[e].abs() @ xt.abs())
                + g.abs() * (up[e].abs() @ xt.abs())
            )
            out[t] += w * (down[e].abs() @ act)
    return out


def run(types, tokens, top_k, dtype, seed=0, as_kernel=None, ids=None, layout="interleaved"):
    """The kernel's output, the reference's and the bound between them. layout "interleaved": the experts
    as `cpu_gguf_moe.pack` keeps them (32-weight block types interleaved); "file": the file's blocks."""
    (gate_raw, gate), (up_raw, up), (down_raw, down) = (
        stacked(types[0], INTER, HIDDEN, seed),
        stacked(types[1], INTER, HIDDEN, seed + 1),
        stacked(types[2], HIDDEN, INTER, seed + 2),
    )
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, chosen = routing(tokens, top_k, seed)
    ids = chosen if ids is None else ids
    if layout == "interleaved":
        kernel = cpu_gguf_moe.pack(gate_raw, up_raw, down_raw, [int(t) for t in types], "silu", "")
    else:
        kernel = cpu_gguf_moe.GgufExperts(gate_raw, up_raw, down_raw, [int(t) for t in types], "silu")
    got = kernel(x, weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, HIDDEN)
    if as_kernel is None:
        as_kernel = torch.Tensor.double if dtype == torch.float32 else quantized_x
    expected, steps = reference(x, weights, ids, gate, up, down, as_kernel)
    return got.double(), expected, 1e-5 * magnitude(x, weights, ids, gate, up, down) + steps


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("tokens", [1, 5])
def test_float32_x_equals_the_dequantized_experts(ggml_type, layout, tokens, two_threads):
    got, expected, bound = run([ggml_type] * 3, tokens, top_k=2, dtype=torch.float32, layout=layout)
    assert ((got - expected).abs() <= bound).all()


@pytest.mark.parametrize(("ggml_type", "layout"), LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("tokens", [1, 5])
def test_bfloat16_x_equals_int8_x_times_the_dequantized_experts(ggml_type, layout, tokens, two_threads):
    got, expected, bound = run([ggml_type] * 3, tokens, top_k=3, dtype=torch.bfloat16, layout=layout)
    # the kernel's float32 sums (and a rare activation code rounded the other way), then bfloat16's rounding
    assert ((got - expected).abs() <= bound + expected.abs() / 128).all()
    assert (got - expected).norm() / expected.norm() < 0.004  # about bfloat16's rounding alone


def test_a_type_per_projection_and_many_tokens(two_threads):
    """Q4_K gate and up with a Q6_K down projection (as llama.cpp's Q4_K_M writes experts), 12 tokens, so
    each expert multiplies several rows at once (a tile of x rows)."""
    got, expected, bound = run([T.Q4_K, T.Q4_K, T.Q6_K], 12, top_k=2, dtype=torch.bfloat16, seed=5)
    assert ((got - expected).abs() <= bound + expected.abs() / 128).all()
    assert (got - expected).norm() / expected.norm() < 0.004


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_with_many_tokens(dtype, two_threads):
    """A prefill chunk's experts, each with more than 32 pairs: float32 x takes slabs of dequantized rows
    through a float32 GEMM (x and the activations as they are); bfloat16 x the int8 tiles, several tiles an
    expert, as it does from two pairs."""
    assert min(torch.bincount(routing(100, 2, seed=7)[1].flatten(), minlength=EXPERTS)) >= 32
    floats = dtype == torch.float32
    got, expected, bound = run(
        [T.Q4_K, T.Q5_0, T.Q6_K],
        100,
        top_k=2,
        dtype=dtype,
        seed=7,
        as_kernel=torch.Tensor.double if floats or not TILES else None,
    )
    assert ((got - expected).abs() <= bound + (0 if floats else expected.abs() / 128)).all()
    assert (got - expected).norm() / expected.norm() < (1e-6 if floats else 0.004)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_expert_with_many_tokens_beside_experts_with_few(dtype, two_threads):
    """Every one of 40 tokens chooses expert 0 (float32: the GEMM path; bfloat16: five tiles) and one other
    (the row products, or tiles of a few rows)."""
    others = torch.randint(1, EXPERTS, (40, 1), generator=torch.Generator().manual_seed(8))
    ids = torch.cat([torch.zeros(40, 1, dtype=torch.long), others], dim=1)
    got, expected, bound = run([T.Q8_0, T.Q4_1, T.Q5_K], 40, top_k=2, dtype=dtype, seed=9, ids=ids)
    assert ((got - expected).abs() <= bound + (0 if dtype == torch.float32 else expected.abs() / 128)).all()


def test_pack_interleaves_the_32_weight_block_types():
    gate_raw, _ = stacked(T.Q8_0, INTER, HIDDEN, 0)
    up_raw, _ = stacked(T.Q5_0, INTER, HIDDEN, 1)
    down_raw, _ = stacked(T.Q4_K, HIDDEN, INTER, 2)
    packed = cpu_gguf_moe.pack(
        gate_raw, up_raw, down_raw, [int(T.Q8_0), int(T.Q5_0), int(T.Q4_K)], "silu", ""
    )
    interleaved = cpu_gguf.INTERLEAVED
    assert packed.run.types == [interleaved + int(T.Q8_0), interleaved + int(T.Q5_0), int(T.Q4_K)]
    assert [b.shape for b in packed.run.blocks] == [gate_raw.shape, up_raw.shape, down_raw.shape]


def test_unchosen_experts_and_types_without_kernel():
    gate_raw, _ = stacked(T.Q8_0, INTER, HIDDEN, 0)
    down_raw, _ = stacked(T.Q8_0, HIDDEN, INTER, 1)
    x = torch.randn(2, HIDDEN)
    ids = torch.tensor([[0], [EXPERTS]])
    kernel = cpu_gguf_moe.GgufExperts(gate_raw, gate_raw, down_raw, [int(T.Q8_0)] * 3, "silu")
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(x, torch.ones(2, 1), ids)
    iq2 = cpu_gguf_moe.GgufExperts(
        gate_raw, gate_raw, down_raw, [int(T.TQ2_0), int(T.Q8_0), int(T.Q8_0)], "silu"
    )
    with pytest.raises(RuntimeError, match="has no kernel"):
        iq2(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long))
    assert not cpu_gguf_moe.runs([int(T.Q4_K), int(T.TQ2_0), int(T.Q4_K)])
    assert cpu_gguf_moe.runs([int(T.Q3_K), int(T.IQ4_XS), int(T.Q2_K)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_mxfp4_experts_with_biases_and_the_clamped_swiglu(dtype, tokens, two_threads):
    """GPT-OSS's experts as the CPU keeps them: MXFP4 blocks, a bias on gate, up and down, the clamped
    SwiGLU. Against `fused_experts_reference` on the dequantized experts (float64): float32 x to float32's
    rounding; bfloat16 x (int8 x and activations) within the int8 rounding's usual error. One token: the
    one-row products; three: a few rows; 40: tiles of eight (bfloat16) or slabs through the GEMM (float32)."""
    (gate_raw, gate), (up_raw, up), (down_raw, down) = (
        stacked(T.MXFP4, INTER, HIDDEN, 11),
        stacked(T.MXFP4, INTER, HIDDEN, 12),
        stacked(T.MXFP4, HIDDEN, INTER, 13),
    )
    g = torch.Generator().manual_seed(14)
    w13_bias, w2_bias = (
        torch.randn(EXPERTS, 2 * INTER, generator=g),
        torch.randn(EXPERTS, HIDDEN, generator=g),
    )
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    weights, ids = routing(tokens, 2, seed=15)
    types = [int(T.MXFP4)] * 3
    kernel = cpu_gguf_moe.pack(gate_raw, up_raw, down_raw, types, moe.SWIGLU_OAI, "", w13_bias, w2_bias)
    got = kernel(x, weights, ids).double()
    expected = moe.fused_experts_reference(
        x.double(),
        torch.cat([gate, up], dim=1),
        down,
        weights,
        ids,
        activation=moe.SWIGLU_OAI,
        w13_bias=w13_bias.double(),
        w2_bias=w2_bias.double(),
    ).double()
    without_biases = cpu_gguf_moe.pack(gate_raw, up_raw, down_raw, types, moe.SWIGLU_OAI, "")(x, weights, ids)
    assert (got - without_biases.double()).norm() > 0.1 * expected.norm()  # the biases matter here
    error = (got - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 0.02), f"relative error {error:.2e}"
