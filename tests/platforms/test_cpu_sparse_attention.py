"""Sparse attention's passes over the cache on the native kernels (platforms/cpu_kernels/sparse_attention.cpp)
against the torch references (models/layers/sparse_attention.py's `index_scores` and `attend_selected`) on
the same rows, read through scattered slots, in float32 and bfloat16 caches, for a decode and a chunk; and
the platform's choice of them, which the model runner hands to the layers."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.sparse_kernels import SparseAttentionKernels
from pagellm.models.layers import sparse_attention
from pagellm.models.layers.sparse_attention import attend_selected, index_scores
from pagellm.platforms import cpu
from pagellm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels split their work across threads


DTYPES = [torch.float32, torch.bfloat16]
"""The cache's and the queries' dtype (the model's): bfloat16 queries on bfloat16 rows take the pair
products where the CPU has them."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries", [1, 5])
# d = 72, not a multiple of the vector width: the tails too; 128: bfloat16 keys in tiles of 16
@pytest.mark.parametrize(("heads", "d"), [(8, 72), (12, 128)])
def test_index_scores_equal_the_reference(kernels, dtype, queries, heads, d):
    g = torch.Generator().manual_seed(0)
    keys = 300  # not a multiple of a tile's 16 keys
    rows = torch.randn(keys + 40, d, generator=g).to(dtype)
    slots = torch.randperm(keys + 40, generator=g)[:keys]
    q = torch.randn(queries, heads, d, generator=g).to(dtype)
    weights = torch.rand(queries, heads, generator=g) * heads**-0.5
    got = kernels.sparse_index_scores(q, rows, slots, weights, 0.11)
    want = index_scores(q, rows[slots], weights, 0.11)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
# k = 300: several blocks of rows in the running softmax; one query's 300 rows also in parts
@pytest.mark.parametrize(("queries", "k"), [(1, 40), (1, 300), (3, 40), (3, 300)])
def test_attention_over_the_chosen_rows_equals_the_reference(kernels, dtype, queries, k):
    g = torch.Generator().manual_seed(1)
    heads, d, v_size, cache = 16, 104, 88, 500
    rows = torch.randn(cache, d, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(cache, generator=g)[:k] for _ in range(queries)])
    valid = torch.rand(queries, k, generator=g) > 0.3
    valid[:, 0] = True  # every query reads at least one row
    q = torch.randn(queries, heads, d, generator=g).to(dtype)
    got = kernels.sparse_attend_rows(q, rows, slots, valid, 0.3, v_size)
    want = attend_selected(q.float(), rows[slots].float(), valid, 0.3, v_size).float()
    if dtype == torch.float32 or not pair_kernels_here(kernels):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bfloat16 rows and queries: the probabilities rounded to bfloat16 for the values' pair products
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        if k <= 64:  # one block of rows: e^(score - its max) rounded, the sum of the unrounded ones
            weights = exponentials(q, rows[slots], valid, 0.3)
            values = rows[slots][..., :v_size].float()
            exact = torch.einsum("qhk,qkv->qhv", weights.bfloat16().float(), values) / weights.sum(
                -1, keepdim=True
            )
            # a weight within float32 noise of a bfloat16 midpoint may round the other way (~2e-5)
            torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-5)
    unread = torch.ones(cache, dtype=torch.bool)
    unread[slots[valid]] = False  # NaN in every row but the valid chosen ones: none of it may leak in
    poisoned = torch.where(unread[:, None], torch.full_like(rows, float("nan")), rows)
    torch.testing.assert_close(kernels.sparse_attend_rows(q, poisoned, slots, valid, 0.3, v_size), got)


def pair_kernels_here(kernels) -> bool:
    """Whether this build multiplies bfloat16 pairs (AVX-512 BF16)."""
    return bool(kernels.bf16_pairs_available())


def exponentials(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """e^(score - the query head's max) over each query's chosen rows, 0 where invalid: [Q, H, k] float32."""
    scores = torch.einsum("qhd,qkd->qhk", q.float(), rows.float()) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return (scores - scores.amax(-1, keepdim=True)).exp()


def test_the_platform_runs_the_passes_on_them_and_the_runner_hands_them_over(kernels, monkeypatch, tmp_path):
    from tiny import make_tiny_checkpoint

    from pagellm import LLM

    chosen = CpuPlatform.sparse_attention_kernels()
    assert chosen == SparseAttentionKernels(kernels.sparse_index_scores, kernels.sparse_attend_rows)
    monkeypatch.setattr(sparse_attention, "_KERNELS", SparseAttentionKernels())
    LLM(
        str(make_tiny_checkpoint("deepseek_v32", tmp_path)),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=32,
    )
    assert sparse_attention._KERNELS == chosen
    monkeypatch.setattr(cpu, "_kernels", lambda: None)  # no compiler: the references
    assert CpuPlatform.sparse_attention_kernels() == SparseAttentionKernels()
