"""The recurrent layers' Triton kernels (`pagellm.platforms.triton_recurrent`) against the plain-torch references
(`recurrent_kernels.REFERENCE`): decode kernels on a state cache whose slots are not in order and whose layout
is not contiguous per slot, grouped heads, head dims that fill no block, prefills whose length is not a multiple
of the chunk (and shorter than the conv's window), bfloat16 and float32 inputs; and the CUDA/ROCm wiring.

Where no GPU is visible the kernels run in Triton's interpreter on CPU tensors (the `triton_interpreter`
fixture), with tiny shapes; where one is, the same tests run compiled on it. Bigger shapes: `-m slow`."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

from pagellm.core.platform import TRITON  # noqa: E402
from pagellm.core.state import RecurrentKernels  # noqa: E402
from pagellm.models.layers.recurrent_kernels import REFERENCE  # noqa: E402
from pagellm.platforms import cuda, rocm, triton_recurrent, xpu  # noqa: E402
from pagellm.platforms.triton_recurrent import TRITON_RECURRENT_KERNELS as TRITON_KERNELS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Relative, and absolute per unit of the largest magnitude: both sides compute in float32 and round the
output once, in a different order."""
DECODE_CASES = [("contiguous", torch.bfloat16), ("strided", torch.float32), ("head_major", torch.bfloat16)]
"""How the state cache lies ([S, ...] contiguous; every other slot of a bigger buffer; heads outermost), each
once, with both input dtypes between them (the interpreter's time per case is what limits the pairs)."""


@pytest.fixture(autouse=True)
def _kernel_mode(request):
    if DEVICE == "cpu":
        request.getfixturevalue("triton_interpreter")


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    tol = TOLERANCE[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item() or 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def state_cache(
    slots: int, shape: tuple[int, ...], layout: str, g: torch.Generator, dtype=torch.float32
) -> torch.Tensor:
    """A random [slots, *shape] cache in `layout`."""
    values = torch.randn(slots, *shape, generator=g).to(dtype).to(DEVICE)
    if layout == "strided":
        cache = torch.zeros(2 * slots, *shape, dtype=dtype, device=DEVICE)[::2]
    elif layout == "head_major":
        cache = torch.zeros(*shape[:1], slots, *shape[1:], dtype=dtype, device=DEVICE).transpose(0, 1)
    else:
        cache = torch.zeros(slots, *shape, dtype=dtype, device=DEVICE)
    assert layout == "contiguous" or not cache.is_contiguous()
    return cache.copy_(values)


SLOTS = torch.tensor([4, 0, 2], device=DEVICE)
"""Three sequences' slots in a cache of six, out of order; slots 1, 3 and 5 must be left as they are."""


def check_decode(name: str, args: tuple, cache: torch.Tensor, dtype: torch.dtype, *after) -> None:
    """The kernel and the reference on copies of the same cache (`name`(*args, cache, SLOTS, *after)): same
    outputs, same cache afterwards, the other slots untouched."""
    want_cache = cache.clone()
    before = cache.clone()
    got = getattr(TRITON_KERNELS, name)(*args, cache, SLOTS, *after)
    want = getattr(REFERENCE, name)(*args, want_cache, SLOTS, *after)
    assert_matches(got, want, dtype)
    assert_matches(cache, want_cache, cache.dtype)
    untouched = [s for s in range(cache.shape[0]) if s not in SLOTS.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize(("layout", "dtype"), DECODE_CASES)
def test_conv1d_update(layout, dtype):
    """Bias and silu (Mamba-2), or neither (the strided case; Gated DeltaNet has silu and no bias)."""
    g = torch.Generator().manual_seed(0)
    channels, width = 40, 4
    x, weight = randn(3, channels, g=g, dtype=dtype), randn(channels, width, g=g, dtype=dtype)
    bias, activation = (randn(channels, g=g, dtype=dtype), "silu") if layout != "strided" else (None, None)
    cache = state_cache(6, (channels, width - 1), layout, g, dtype)
    check_decode("conv1d_update", (x, weight, bias), cache, dtype, activation)


def test_conv1d_update_refuses_other_activations():
    x, weight, cache = torch.zeros(3, 4), torch.zeros(4, 4), torch.zeros(6, 4, 3)
    with pytest.raises(ValueError, match="gelu"):
        TRITON_KERNELS.conv1d_update(x, weight, None, cache, SLOTS, "gelu")


@pytest.mark.parametrize(("layout", "dtype"), DECODE_CASES)
def test_gated_delta_rule_update(layout, dtype):
    """Dk 16 and Dv 24 (a value block partly filled); q and k of the key heads repeated as the layer does."""
    g = torch.Generator().manual_seed(1)
    heads, dk, dv = 4, 16, 24
    q = randn(3, 2, dk, g=g, dtype=dtype).repeat_interleave(2, dim=1)
    k = randn(3, 2, dk, g=g, dtype=dtype).repeat_interleave(2, dim=1)
    v = randn(3, heads + 1, dv, g=g, dtype=dtype)[:, 1:]  # a view, as the layer's split of the conv output
    decay = -torch.rand(3, heads, generator=g).to(DEVICE)
    beta = torch.rand(3, heads, generator=g).to(DEVICE)
    cache = state_cache(6, (heads, dk, dv), layout, g)
    check_decode("gated_delta_rule_update", (q, k, v, decay, beta), cache, dtype)


@pytest.mark.parametrize(("layout", "dtype"), DECODE_CASES)
def test_selective_state_update(layout, dtype):
    """Four heads in two groups of B and C; P 24 and N 16."""
    g = torch.Generator().manual_seed(2)
    heads, groups, head_dim, d_state = 4, 2, 24, 16
    x = randn(3, heads, head_dim, g=g, dtype=dtype)
    dt = randn(3, heads, g=g, dtype=dtype)
    A = -torch.rand(heads, generator=g).to(DEVICE) - 0.5
    bc = randn(3, 2 * groups, d_state, g=g, dtype=dtype)
    B, C = bc[:, :groups], bc[:, groups:]
    D, dt_bias = randn(heads, g=g), randn(heads, g=g)
    cache = state_cache(6, (heads, head_dim, d_state), layout, g)
    check_decode("selective_state_update", (x, dt, A, B, C, D, dt_bias), cache, dtype)


def check_prefill(name: str, args: tuple, state: torch.Tensor, dtype: torch.dtype, *after) -> None:
    """The kernel and the reference: same output and new state, and `state` read, not written."""
    before = state.clone()
    got, got_state = getattr(TRITON_KERNELS, name)(*args, state, *after)
    want, want_state = getattr(REFERENCE, name)(*args, state, *after)
    assert_matches(got, want, dtype)
    assert_matches(got_state, want_state, state.dtype)
    assert torch.equal(state, before)


@pytest.mark.parametrize(
    ("length", "dtype", "bias"),
    [
        (1, torch.float32, True),
        (2, torch.bfloat16, False),
        (37, torch.float32, False),
        (37, torch.bfloat16, True),
    ],
)
def test_causal_conv1d_prefill(length, dtype, bias):
    """Fewer tokens than the window's K-1 carried inputs (the new state mixes old state and x), and more."""
    g = torch.Generator().manual_seed(3)
    channels, width = 40, 4
    x = randn(length, channels + 8, g=g, dtype=dtype)[:, 8:]
    weight = randn(channels, width, g=g, dtype=dtype)
    state = state_cache(2, (channels, width - 1), "strided", g, dtype)[1]
    args = (x, weight, randn(channels, g=g, dtype=dtype) if bias else None)
    check_prefill("causal_conv1d_prefill", args, state, dtype, "silu" if bias else None)


def delta_rule_case(length: int, heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = randn(length, heads // 2, dk, g=g, dtype=dtype).repeat_interleave(2, dim=1)
    k = randn(length, heads // 2, dk, g=g, dtype=dtype).repeat_interleave(2, dim=1)
    v = randn(length, heads, dv, g=g, dtype=dtype)
    decay = -torch.rand(length, heads, generator=g).to(DEVICE) * 0.5
    beta = torch.rand(length, heads, generator=g).to(DEVICE)
    state = state_cache(3, (heads, dk, dv), "head_major", g)[2] * 0.1
    return (q, k, v, decay, beta), state


@pytest.mark.parametrize(("length", "dtype"), [(1, torch.float32), (45, torch.float32), (70, torch.bfloat16)])
def test_chunk_gated_delta_rule(length, dtype):
    """One token, a chunk and a part, two chunks and a part (the kernel's chunk is 32)."""
    args, state = delta_rule_case(length, 2, 16, 24, dtype, seed=4)
    check_prefill("chunk_gated_delta_rule", args, state, dtype)


def ssd_case(
    length: int, heads: int, groups: int, head_dim: int, d_state: int, dtype: torch.dtype, seed: int
):
    g = torch.Generator().manual_seed(seed)
    x = randn(length, heads, head_dim, g=g, dtype=dtype)
    dt = randn(length, heads, g=g, dtype=dtype)
    A = -torch.rand(heads, generator=g).to(DEVICE) - 0.5
    bc = randn(length, 2 * groups, d_state, g=g, dtype=dtype)
    D, dt_bias = randn(heads, g=g), randn(heads, g=g)
    state = state_cache(3, (heads, head_dim, d_state), "strided", g)[1]
    return (x, dt, A, bc[:, :groups], bc[:, groups:], D, dt_bias), state


@pytest.mark.parametrize(
    ("length", "dtype", "dt_limit"),
    [
        (1, torch.float32, (0.0, float("inf"))),
        (45, torch.float32, (0.2, 1.0)),
        (70, torch.bfloat16, (0.0, 5.0)),
    ],
)
def test_ssd_chunk_scan(length, dtype, dt_limit):
    """Grouped heads, chunk_size 16 in the reference, 32 in the kernel; with and without a dt clamp."""
    args, state = ssd_case(length, 4, 2, 24, 16, dtype, seed=5)
    check_prefill("ssd_chunk_scan", args, state, dtype, 16, dt_limit)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bigger_shapes(dtype):
    """Model-like head dims (several value blocks in decode and prefill) and a few chunks."""
    g = torch.Generator().manual_seed(6)
    heads, dk, dv, length = 4, 128, 128, 100
    args, state = delta_rule_case(length, heads, dk, dv, dtype, seed=6)
    check_prefill("chunk_gated_delta_rule", args, state, dtype)
    step = tuple(t[:3] for t in args)
    check_decode("gated_delta_rule_update", step, state_cache(6, (heads, dk, dv), "head_major", g), dtype)
    args, state = ssd_case(length, 8, 2, 64, 128, dtype, seed=7)
    check_prefill("ssd_chunk_scan", args, state, dtype, 64)
    step = tuple(t[:3] for t in args[:2]) + args[2:3] + tuple(t[:3] for t in args[3:5]) + args[5:]
    check_decode("selective_state_update", step, state_cache(6, (8, 64, 128), "strided", g), dtype)
    x, weight = randn(length, 1000, g=g, dtype=dtype), randn(1000, 4, g=g, dtype=dtype)
    conv = state_cache(6, (1000, 3), "strided", g, dtype)
    check_prefill("causal_conv1d_prefill", (x, weight, randn(1000, g=g, dtype=dtype)), conv[1], dtype, "silu")
    check_decode("conv1d_update", (x[:3], weight, None), conv, dtype, "silu")


@pytest.mark.parametrize("platform", [cuda.CudaPlatform, rocm.RocmPlatform])
def test_cuda_and_rocm_return_the_kernels(platform, monkeypatch):
    monkeypatch.setattr(cuda, "triton_capability", lambda: frozenset({TRITON}))
    monkeypatch.setattr(rocm, "triton_capability", lambda: frozenset({TRITON}))
    assert platform.recurrent_kernels() is TRITON_KERNELS
    assert "none" not in TRITON_KERNELS.describe()


def test_references_without_triton_or_off_cuda(monkeypatch):
    assert xpu.XpuPlatform.recurrent_kernels() == RecurrentKernels()
    monkeypatch.setattr(cuda, "triton_capability", lambda: frozenset())
    assert cuda.CudaPlatform.recurrent_kernels() == RecurrentKernels()


def test_jitted_once_per_mode(monkeypatch):
    interpreted = triton_recurrent._kernels()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = triton_recurrent._kernels()
    assert compiled is not interpreted and compiled is triton_recurrent._kernels()


@pytest.mark.slow  # the interpreter runs every layer's conv and scan: about a minute
@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid"])
def test_models_match_transformers_with_the_kernels(arch, tmp_path, monkeypatch, caplog):
    """The layers' calls (split views, the state cache's slots) reach the kernels as the references take them:
    greedy parity under chunked prefill with the Triton kernels in place of the references."""
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from tiny import make_tiny_checkpoint

    from pagellm import LLM
    from pagellm.platforms.cpu import CpuPlatform

    if DEVICE != "cpu":
        pytest.skip("the engine runs on the session's device; this checks the kernels on CPU tensors")
    monkeypatch.setattr(CpuPlatform, "recurrent_kernels", classmethod(lambda cls: TRITON_KERNELS))
    path = make_tiny_checkpoint(arch, tmp_path)
    reference = Reference(path, 8)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(
            str(path),
            dtype="float32",
            max_model_len=200,
            num_kv_blocks=128,
            max_num_batched_tokens=32,
            max_num_seqs=4,
        )
    assert "recurrent layers' kernels: " + TRITON_KERNELS.describe() in caplog.text
    assert_greedy_parity(llm, reference, [p for p in mixed_prompts(150, seed=1) if len(p) <= 80][:4])
