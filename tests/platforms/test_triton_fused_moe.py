"""The Triton fused-MoE kernel (`pagellm.platforms.triton_moe`) against `fused_experts_reference`: each
activation with and without biases, half dtypes, the routings that stress the block alignment (one token,
all tokens to one expert over several blocks, top-k = E, experts no token chose, no tokens), sizes that
fill no tile, the tile table, and the CUDA/ROCm `pack_moe` wiring.

Where no GPU is visible the kernel runs in Triton's interpreter on CPU tensors (the `triton_interpreter`
fixture), with tiny shapes so the file takes a few seconds; where one is, the same tests run compiled on
it, plus a CUDA-graph capture, so this file is also the device check. Bigger matrices: `-m slow`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagellm.core.moe import ACTIVATIONS, GELU_TANH, SILU, SWIGLU_OAI, fused_experts_reference  # noqa: E402
from pagellm.platforms import _common, cuda, rocm, xpu  # noqa: E402
from pagellm.platforms.triton_moe import (  # noqa: E402
    TILE_TABLE,
    Tile,
    align_to_blocks,
    fused_experts_triton,
    m_bucket,
    pack_triton_moe,
    tile_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
"""Relative, and absolute per unit of the output's largest magnitude: the kernel accumulates each product
in float32 and rounds the activation once, the reference rounds each product too."""
ONE_TILE = Tile(16, 64, 64)
"""One tile across N in both GEMMs at the default sizes (still partly filled): half the interpreter's
programs of the default tile, for tests of something other than the tiling."""


@pytest.fixture(autouse=True)
def _kernel_mode(request):
    if DEVICE == "cpu":
        request.getfixturevalue("triton_interpreter")


def make_case(
    num_tokens: int,
    top_k: int,
    *,
    routing: str = "random",
    num_experts: int = 4,
    hidden_size: int = 40,
    inter: int = 24,
    bias: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """(hidden, w13, w2, topk_weights, topk_ids) and the biases, on DEVICE. Default sizes fill no tile:
    40 and 24 are multiples of neither 32 nor 64."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=g) / hidden_size**0.5
    w2 = torch.randn(num_experts, hidden_size, inter, generator=g) / inter**0.5
    biases = {
        "w13_bias": torch.randn(num_experts, 2 * inter, generator=g) if bias else None,
        "w2_bias": torch.randn(num_experts, hidden_size, generator=g) if bias else None,
    }
    if routing == "all_to_one":
        ids = torch.full((num_tokens, top_k), 2)
    elif routing == "empty_experts":  # only experts 0 and 3 chosen
        ids = torch.rand(num_tokens, 2, generator=g).argsort(dim=1)[:, :top_k] * 3
    else:  # top_k distinct experts per token
        ids = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=g)
    tensors = (hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids.to(torch.int64))
    biases = {name: None if b is None else b.to(dtype).to(DEVICE) for name, b in biases.items()}
    return tuple(t.to(DEVICE) for t in tensors), biases


def check(case, activation: str = SILU, tile: Tile | None = None) -> None:
    (hidden, w13, w2, weights, ids), biases = case
    got = fused_experts_triton(hidden, w13, w2, weights, ids, activation=activation, tile=tile, **biases)
    want = fused_experts_reference(hidden, w13, w2, weights, ids, activation=activation, **biases)
    assert got.shape == want.shape and got.dtype == hidden.dtype
    assert_matches(got, want)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[want.dtype]
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_each_activation_matches_the_reference(activation, bias):
    check(make_case(3, 2, bias=bias), activation, ONE_TILE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_dtypes(dtype):
    check(make_case(7, 2, bias=True, dtype=dtype), SWIGLU_OAI)  # 7 > 4 experts: 64-row blocks, two K steps


ROUTINGS = {  # name: (tokens, top_k, make_case keywords, tile)
    "one_token": (1, 2, {}, ONE_TILE),
    "many_tokens": (37, 3, {}, None),  # the default tile: 64-row blocks, two K steps
    "all_to_one_over_three_blocks": (40, 1, {"routing": "all_to_one"}, Tile(16, 32, 32)),
    "top_k_is_e": (3, 4, {}, ONE_TILE),
    "empty_experts": (4, 2, {"routing": "empty_experts"}, None),  # the default tile: 16-row blocks
    "no_tokens": (0, 2, {}, None),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routings(routing):
    tokens, top_k, keywords, tile = ROUTINGS[routing]
    check(make_case(tokens, top_k, bias=True, **keywords), GELU_TANH, tile)


@pytest.mark.parametrize("routing", ["random", "all_to_one", "empty_experts"])
@pytest.mark.parametrize("block_m", [1, 16])
def test_alignment_puts_each_expert_in_whole_blocks(routing, block_m):
    (*_, ids), _ = make_case(9, 2, routing=routing)
    num_experts, num_pairs = 4, ids.numel()
    sorted_ids, expert_ids, padded = align_to_blocks(ids, num_experts, block_m)
    padded = int(padded)
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert len(sorted_ids) >= padded and len(sorted_ids) % block_m == 0
    assert len(expert_ids) == len(sorted_ids) // block_m
    used = sorted_ids[:padded].cpu()
    assert sorted(used[used < num_pairs].tolist()) == list(range(num_pairs))  # every pair once
    assert (sorted_ids[padded:] == num_pairs).all()
    flat = ids.flatten().cpu()
    for block, expert in enumerate(expert_ids[: padded // block_m].cpu().tolist()):
        rows = used[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert len(rows) > 0 and (flat[rows] == expert).all()  # no empty block, one expert per block


def test_tiles_come_from_the_table_by_m_bucket():
    assert [m_bucket(n) for n in (1, 2, 3, 16, 17, 4096)] == [1, 2, 4, 16, 32, 4096]
    (shape, rows) = next(iter(TILE_TABLE.items()))
    first_largest, first = rows[0]
    assert tile_for(*shape, first_largest, torch.bfloat16) == first
    assert tile_for(*shape, first_largest + 1, torch.bfloat16) == rows[1][1]
    assert tile_for(*shape, 10**6, torch.float16) == rows[-1][1]
    assert tile_for(*shape, 1, torch.float32) == Tile(16, 32, 64)  # tuned for 16-bit weights only
    assert tile_for(8, 24, 40, 8, torch.bfloat16) == Tile(16, 32, 64)
    assert tile_for(8, 24, 40, 9, torch.bfloat16) == Tile(64, 64, 32)


def test_table_tiles_are_tiles_the_kernel_takes():
    """Powers of two, every tl.dot dimension at least 16 (the gated GEMM's block_n // 2 too), buckets
    rising."""
    for rows in TILE_TABLE.values():
        assert [largest for largest, _ in rows] == sorted({largest for largest, _ in rows})
        for _, tile in rows:
            for size in (tile.block_m, tile.block_n // 2, tile.block_k):
                assert size >= 16 and size & (size - 1) == 0


@pytest.mark.parametrize("platform", [cuda.CudaPlatform, rocm.RocmPlatform])
def test_cuda_and_rocm_pack_the_kernel(platform, monkeypatch):
    if DEVICE == "cpu":  # CPU tensors reach the kernel here only through the interpreter
        monkeypatch.setattr(_common, "triton_moe_runs", lambda w13: True)
    (hidden, w13, w2, weights, ids), biases = make_case(4, 2, bias=True)
    packed = platform.pack_moe(w13, w2, biases["w13_bias"], biases["w2_bias"], SWIGLU_OAI)
    assert packed is not None and "Triton" in packed.description
    assert_matches(
        packed(hidden, weights, ids),
        fused_experts_reference(hidden, w13, w2, weights, ids, activation=SWIGLU_OAI, **biases),
    )


def test_no_kernel_without_triton_or_off_cuda(monkeypatch):
    w13, w2 = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    assert cuda.CudaPlatform.pack_moe(w13, w2, None, None, SILU) is None  # CPU weights
    assert xpu.XpuPlatform.pack_moe(w13, w2, None, None, SILU) is None
    monkeypatch.setattr(_common, "triton_moe_runs", lambda w13: True)
    monkeypatch.setattr(cuda, "triton_capability", lambda: frozenset())
    assert cuda.CudaPlatform.pack_moe(w13, w2, None, None, SILU) is None


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="relu"):
        pack_triton_moe(torch.zeros(2, 8, 4), torch.zeros(2, 4, 4), None, None, "relu")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_captured_in_a_cuda_graph():
    """No host synchronisation in a step: captured once, replayed over another routing of the same shape."""
    (hidden, w13, w2, weights, ids), biases = make_case(6, 2, bias=True, dtype=torch.bfloat16)
    run = pack_triton_moe(w13, w2, biases["w13_bias"], biases["w2_bias"], SILU)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(hidden, weights, ids)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(hidden, weights, ids)
    (new_hidden, _, _, new_weights, new_ids), _ = make_case(6, 2, seed=1, dtype=torch.bfloat16)
    for static, new in ((hidden, new_hidden), (weights, new_weights), (ids, new_ids)):
        static.copy_(new)
    graph.replay()
    assert_matches(out, fused_experts_reference(hidden, w13, w2, weights, ids, activation=SILU, **biases))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tokens", [3, 33])
def test_bigger_matrices(tokens, activation, bias, dtype):
    """8 experts, top-3, hidden 136 and intermediate 72: several tiles and K steps in both GEMMs."""
    case = make_case(tokens, 3, num_experts=8, hidden_size=136, inter=72, bias=bias, dtype=dtype)
    check(case, activation)


@pytest.mark.slow
@pytest.mark.parametrize("tile", sorted({tile for rows in TILE_TABLE.values() for _, tile in rows}, key=str))
def test_every_table_tile_runs(tile):
    check(make_case(20, 2, bias=True, dtype=torch.float16), SILU, tile)
