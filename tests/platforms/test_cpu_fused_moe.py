"""The native CPU fused-MoE kernel (platforms/cpu_kernels/fused_moe.cpp via CpuPlatform.pack_moe) against
core/moe.py's `fused_experts_reference`, its fallback when the kernels cannot be had, and its op under
torch.compile.

bfloat16 is checked two ways: against the reference run in bfloat16 (which rounds gate/up, the activation
and the down projection to bfloat16 on the way, so the two differ by a few such roundings), and against the
reference run in float32 on the same bfloat16 values, which the kernel (float32 inside, one rounding at the
end) must match to about half a bfloat16 step.

Quantized experts (int8, fp8 e4m3; weight-only, per-row scales) are checked against the reference on the
same quantized weights, which dequantizes each chosen expert, with float32 and bfloat16 hidden states."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm.core.moe import ACTIVATIONS, SWIGLU_OAI, fused_experts_reference
from pagellm.platforms import cpu_kernels, cpu_moe
from pagellm.platforms.cpu import CpuPlatform
from pagellm.quantization.fp8 import Fp8Method
from pagellm.quantization.int8 import Int8Method

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels split their work across threads

QUANTIZED = {"int8": Int8Method, "fp8": Fp8Method}


# name: (tokens, top_k, experts, hidden, intermediate); hidden and intermediate not multiples of the
# vector width (8) or the panel (16) unless a case needs the even path
SHAPES = {
    "random": (9, 2, 6, 37, 13),
    "one_token": (1, 2, 6, 37, 13),
    "all_to_one": (11, 2, 6, 37, 13),
    "top_k_is_e": (5, 6, 6, 37, 13),
    "empty_experts": (9, 2, 6, 37, 13),
    "no_tokens": (0, 2, 6, 37, 13),
    "many_tokens": (300, 4, 8, 64, 24),
}


def make_case(case: str, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens, top_k, experts, hidden_size, inter = SHAPES[case]
    hidden = torch.randn(tokens, hidden_size, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5 * 2
    w2 = torch.randn(experts, hidden_size, inter, generator=g) / inter**0.5
    w13_bias = torch.randn(experts, 2 * inter, generator=g) if bias else None
    w2_bias = torch.randn(experts, hidden_size, generator=g) if bias else None
    if case == "no_tokens":
        ids = torch.zeros(0, top_k, dtype=torch.int64)
    elif case == "all_to_one":
        ids = torch.tensor([[3, 1]] * tokens)
    elif case == "empty_experts":
        ids = torch.stack([torch.randperm(2, generator=g) * 4 for _ in range(tokens)])  # experts 0 and 4
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)

    def cast(t):
        return None if t is None else t.to(dtype)

    return cast(hidden), cast(w13), cast(w2), weights, ids, cast(w13_bias), cast(w2_bias)


def matrix():
    """Every case x activation x bias; in the default run, every activation with and without biases on
    random routings and a long step, the other cases with one of them (the rest under -m slow)."""
    for case in SHAPES:
        for activation in ACTIVATIONS:
            for bias in (False, True):
                default = case in ("random", "many_tokens") or (activation, bias) == (SWIGLU_OAI, True)
                marks = () if default else (pytest.mark.slow,)
                name = f"{case}-{activation}-{'bias' if bias else 'nobias'}"
                yield pytest.param(case, activation, bias, marks=marks, id=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "activation", "bias"), list(matrix()))
def test_kernel_matches_the_reference(kernels, dtype, activation, bias, case):
    hidden, w13, w2, weights, ids, w13_bias, w2_bias = make_case(case, dtype, bias)
    packed = CpuPlatform.pack_moe(w13, w2, w13_bias, w2_bias, activation)
    assert packed is not None and packed.description == f"native CPU kernel, {kernels.fused_moe_isa()}"
    got = packed(hidden, weights, ids)
    assert got.shape == hidden.shape and got.dtype == dtype

    def reference(cast):
        return fused_experts_reference(
            *(cast(t) for t in (hidden, w13, w2)),
            weights,
            ids,
            activation=activation,
            w13_bias=None if w13_bias is None else cast(w13_bias),
            w2_bias=None if w2_bias is None else cast(w2_bias),
        )

    if dtype == torch.float32:
        torch.testing.assert_close(got, reference(lambda t: t), rtol=1e-5, atol=1e-5)
        return
    # the reference in bfloat16: a few bfloat16 roundings apart, relative to the output's scale
    want = reference(lambda t: t).float()
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * scale)
    # the reference in float32 on the same values: one rounding of the float32 result apart
    exact = reference(lambda t: t.float())
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-4)


def quantized_matrix():
    """`matrix()` for int8 and fp8 experts with float32 hidden states in the default run (bfloat16
    hidden states, and the cases `matrix()` leaves out, under -m slow)."""
    for param in matrix():
        slow = any(mark.name == "slow" for mark in param.marks)
        for method in QUANTIZED:
            for hidden in ("fp32", "bf16"):
                marks = (pytest.mark.slow,) if slow or hidden == "bf16" else ()
                yield pytest.param(
                    method, hidden, *param.values, marks=marks, id=f"{method}-{hidden}-{param.id}"
                )


@pytest.mark.parametrize(("method", "hidden_dtype", "case", "activation", "bias"), list(quantized_matrix()))
def test_quantized_kernel_matches_the_reference(kernels, method, hidden_dtype, case, activation, bias):
    hidden, w13, w2, weights, ids, w13_bias, w2_bias = make_case(case, torch.float32, bias)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[hidden_dtype]
    hidden = hidden.to(dtype)
    (q13, s13), (q2, s2) = QUANTIZED[method].quantize_rows(w13), QUANTIZED[method].quantize_rows(w2)
    packed = CpuPlatform.pack_moe(q13, q2, w13_bias, w2_bias, activation, w13_scale=s13, w2_scale=s2)
    name = {"int8": "int8", "fp8": "float8_e4m3fn"}[method]
    assert packed is not None and packed.description.endswith(f", {name} weight-only")
    got = packed(hidden, weights, ids)
    assert got.shape == hidden.shape and got.dtype == dtype
    want = fused_experts_reference(
        hidden.float(),
        q13,
        q2,
        weights,
        ids,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        w13_scale=s13,
        w2_scale=s2,
    )
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # float32 inside, one rounding to bfloat16 at the end
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4)


def test_every_e4m3_value_reaches_the_kernel(kernels):
    """All 254 finite e4m3 codes (subnormals, both zeros, +-448) as weights: token t is the unit vector t,
    so its gate and up are code t times the scale (2^-7, exact, keeping SiLU's argument in [-3.5, 3.5])."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # not NaN
    hidden_size, inter = len(codes), 8
    w13 = codes.repeat(1, 2 * inter, 1).view(torch.float8_e4m3fn)  # [1, 16, 254]: every row holds every code
    w2 = torch.ones(1, hidden_size, inter).to(torch.float8_e4m3fn)
    scales = torch.full((1, 2 * inter), 2.0**-7), torch.ones(1, hidden_size)
    tokens, weights, ids = (
        torch.eye(hidden_size),
        torch.ones(hidden_size, 1),
        torch.zeros(hidden_size, 1).long(),
    )
    packed = CpuPlatform.pack_moe(w13, w2, None, None, "silu", w13_scale=scales[0], w2_scale=scales[1])
    want = fused_experts_reference(tokens, w13, w2, weights, ids, w13_scale=scales[0], w2_scale=scales[1])
    assert int((want[:, 0] == 0).sum()) == 2  # +0 and -0; the rest distinct values
    torch.testing.assert_close(packed(tokens, weights, ids), want, rtol=1e-6, atol=0)


def test_quantized_experts_need_their_scales(kernels):
    _, w13, w2, _, _, _, _ = make_case("random", torch.float32, False)
    (q13, s13), (q2, s2) = Int8Method.quantize_rows(w13), Int8Method.quantize_rows(w2)
    with pytest.raises(ValueError, match="scales"):
        CpuPlatform.pack_moe(q13, q2, None, None, "silu")
    with pytest.raises(ValueError, match="scales"):
        CpuPlatform.pack_moe(w13, w2, None, None, "silu", w13_scale=s13, w2_scale=s2)


def test_swiglu_clamps_reach_the_kernel(kernels):
    """Gates and ups far beyond GPT-OSS's limit (7): the clamps, not just the smooth part, are exercised."""
    hidden, w13, w2, weights, ids, w13_bias, w2_bias = make_case("random", torch.float32, True)
    w13 = w13 * 20
    packed = CpuPlatform.pack_moe(w13, w2, w13_bias, w2_bias, SWIGLU_OAI)
    want = fused_experts_reference(
        hidden, w13, w2, weights, ids, activation=SWIGLU_OAI, w13_bias=w13_bias, w2_bias=w2_bias
    )
    assert float((hidden @ w13[0].T).abs().max()) > 30
    # sums of terms up to ~100 in float32, in another order than the reference's
    torch.testing.assert_close(packed(hidden, weights, ids), want, rtol=1e-5, atol=1e-4)


def test_chunks_of_tokens_add_up(kernels):
    """Steps longer than the kernel's buffers (32 MB of float32) run in chunks of tokens: 2100 tokens x 8
    experts at hidden 1024 make three chunks (1016 tokens a chunk)."""
    g = torch.Generator().manual_seed(1)
    tokens, top_k, experts, hidden_size, inter = 2100, 8, 16, 1024, 8
    hidden = torch.randn(tokens, hidden_size, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=g) / 16
    w2 = torch.randn(experts, hidden_size, inter, generator=g) / 3
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    packed = CpuPlatform.pack_moe(w13, w2, None, None, "silu")
    want = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(packed(hidden, weights, ids), want, rtol=1e-5, atol=1e-4)


def test_out_of_range_expert_ids_are_refused(kernels):
    hidden, w13, w2, weights, ids, _, _ = make_case("random", torch.float32, False)
    packed = CpuPlatform.pack_moe(w13, w2, None, None, "silu")
    ids[2, 1] = w13.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        packed(hidden, weights, ids)


def test_packed_layout_keeps_every_weight_once():
    """The packing is a permutation plus zero padding: each panel's columns, read back in the kernel's
    order, are the gate/up (w13) and output (w2) rows they stand for."""
    for dtype in cpu_moe.DTYPES:
        w13 = torch.randn(3, 2 * 13, 37).mul(10).to(dtype)
        w2 = torch.randn(3, 37, 13).mul(10).to(dtype)
        if dtype.itemsize == 1:  # compared as bytes (float8 has no equality)
            w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        p13, p2 = cpu_moe.pack_w13(w13), cpu_moe.pack_w2(w2)
        assert p13.shape == (3, 2, 37, 16) and p2.shape == (3, 3, 13, 16)
        order = [*range(0, 16, 2), *range(1, 16, 2)] if dtype == torch.bfloat16 else list(range(16))
        cols13 = p13[..., order].transpose(-1, -2)  # [E, panel, 16 logical columns, H]
        gate = cols13[:, :, :8].reshape(3, 16, 37)
        up = cols13[:, :, 8:].reshape(3, 16, 37)
        assert torch.equal(gate[:, :13], w13[:, :13]) and torch.equal(up[:, :13], w13[:, 13:])
        assert not gate[:, 13:].any() and not up[:, 13:].any()
        rows2 = p2[..., order].transpose(-1, -2).reshape(3, 48, 13)
        assert torch.equal(rows2[:, :37], w2) and not rows2[:, 37:].any()


def test_without_the_kernels_pack_moe_says_why_once(monkeypatch, caplog):
    """PAGELLM_CPU_KERNELS=0 (or no compiler): pack_moe returns None, so layers run the reference, and the
    log says why once however many layers ask."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpu_kernels, "_why_not", None)
    _, w13, w2, _, _, _, _ = make_case("random", torch.float32, False)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        assert CpuPlatform.pack_moe(w13, w2, None, None, "silu") is None
        assert CpuPlatform.pack_moe(w13, w2, None, None, "silu") is None
    said = [r.getMessage() for r in caplog.records if "MoE experts the reference" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(": PAGELLM_CPU_KERNELS=0")


def test_other_dtypes_run_the_reference(kernels):
    _, w13, w2, _, _, _, _ = make_case("random", torch.float16, False)
    assert CpuPlatform.pack_moe(w13, w2, None, None, "silu") is None


def test_the_op_compiles_opaquely(kernels, tmp_path, monkeypatch):
    """Under torch.compile (inductor, dynamic shapes, as CpuPlatform.compile_model) the kernel is one op in
    the graph, the packed weights held by a module's PackedMoE, and gives the eager result."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    hidden, w13, w2, weights, ids, w13_bias, w2_bias = make_case("many_tokens", torch.bfloat16, True)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = CpuPlatform.pack_moe(w13, w2, w13_bias, w2_bias, "silu")

        def forward(self, x, topk_weights, topk_ids):
            return self.experts(x * 2, topk_weights, topk_ids) + 1

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (7, 300):
        args = (hidden[:rows], weights[:rows], ids[:rows])
        torch.testing.assert_close(compiled(*args), layer(*args), rtol=0, atol=0)
