import pytest
import torch
import torch.nn.functional as F

from pagellm.attention_backends import _base, torch_sdpa
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_backend, make_paged_batch, reference_attention

# (seq_lens, query_lens): the query tokens are the last ones of each sequence
CASES = {
    "prefill": [([17], [17]), ([33, 1, 16, 15], [33, 1, 16, 15])],
    "chunked_prefill": [([40], [8]), ([64, 33], [32, 17]), ([17, 50], [2, 16])],
    "decode": [([15, 16, 17, 32, 33, 1], [1] * 6), ([70], [1])],
    "mixed": [([40, 17, 5, 33], [8, 1, 1, 17]), ([5, 40, 6, 64], [1, 8, 1, 64]), ([50, 20, 9], [1, 20, 1])],
}
ALL_CASES = [case for cases in CASES.values() for case in cases]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(kind, heads, block_size):
    spec = AttentionSpec(*heads, head_size=32, dtype=torch.float32, block_size=block_size)
    assert check_backend(TorchSDPABackend, spec, "cpu", CASES[kind]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 7, 20])
def test_dtypes_and_sliding_window(dtype, sliding_window):
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16, sliding_window=sliding_window)
    assert check_backend(TorchSDPABackend, spec, "cpu", ALL_CASES) < TOLERANCE[dtype]


def test_gqa_reaches_sdpa_as_4d_heads_without_enable_gqa(monkeypatch):
    """CUDA's fused kernels refuse 3-D inputs with a bool mask and enable_gqa (and CPU falls back to the math
    path), so grouped heads go in as [KV, group] with K/V broadcast (issue 17)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.dim(), q.shape[:-2] == k.shape[:-2], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", spy)
    spec = AttentionSpec(8, 2, head_size=32, dtype=torch.float32, block_size=16)
    assert check_backend(TorchSDPABackend, spec, "cpu", CASES["mixed"]) < 1e-5
    assert calls and all(dims >= 4 and same_heads and not gqa for dims, same_heads, gqa in calls)


def test_logits_soft_cap():
    spec = AttentionSpec(8, 2, 32, torch.float32, sliding_window=9, logits_soft_cap=5.0)
    assert check_backend(TorchSDPABackend, spec, "cpu", ALL_CASES) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "features",
    [dict(has_sinks=True), dict(has_sinks=True, sliding_window=7), dict(has_sinks=True, logits_soft_cap=5.0)],
    ids=["sinks", "sinks-window", "sinks-soft_cap"],
)
def test_sinks(dtype, features):
    spec = AttentionSpec(8, 2, 32, dtype, **features)
    assert check_backend(TorchSDPABackend, spec, "cpu", ALL_CASES) < TOLERANCE[dtype]


def test_explicit_path_slices_long_queries(monkeypatch):
    """Soft-capped and sink layers compute scores in float32 ops, a slice of the queries at a time."""
    monkeypatch.setattr(_base, "EXPLICIT_SCORES", 8 * 40 * 3)  # 3 query rows of 8 heads over 40 keys
    spec = AttentionSpec(8, 2, 32, torch.float32, sliding_window=20, logits_soft_cap=5.0, has_sinks=True)
    assert check_backend(TorchSDPABackend, spec, "cpu", CASES["chunked_prefill"] + CASES["mixed"]) < 1e-5


def test_check_backend_catches_ignored_sinks_and_soft_cap():
    class NoSinks(TorchSDPABackend):
        name = "NO_SINKS"

        def forward(self, q, k, v, kv_cache, metadata, sinks=None):
            return super().forward(q, k, v, kv_cache, metadata)

    spec = AttentionSpec(4, 2, 32, torch.float32, has_sinks=True)
    assert check_backend(NoSinks, spec, "cpu", CASES["mixed"]) > 0.1
    uncapped = AttentionSpec(4, 2, 32, torch.float32, logits_soft_cap=1.0)
    assert check_backend(TorchSDPABackend, uncapped, "cpu", CASES["mixed"]) < 1e-5

    class NoCap(TorchSDPABackend):
        name = "NO_CAP"

        def __init__(self, spec):
            super().__init__(spec)
            self.spec = AttentionSpec(4, 2, 32, torch.float32)

    assert check_backend(NoCap, uncapped, "cpu", CASES["mixed"]) > 0.05


def test_cache_dtype_differs_from_compute_dtype():
    spec = AttentionSpec(8, 2, 32, torch.bfloat16, kv_cache_dtype=torch.float32)
    assert check_backend(TorchSDPABackend, spec, "cpu", ALL_CASES) < TOLERANCE[torch.bfloat16]


def test_negative_slots_are_not_written():
    spec = AttentionSpec(4, 2, 8, torch.float32, block_size=16)
    batch = make_paged_batch([20, 5], [20, 5], 16, num_blocks=8, generator=torch.Generator().manual_seed(0))
    skipped = batch.slot_mapping[[3, 22]].clone()
    batch.slot_mapping[[3, 22]] = -1
    k = torch.randn(25, 2, 8)
    v = torch.randn(25, 2, 8)
    kv_cache = torch.zeros(TorchSDPABackend.kv_cache_shape(8, 16, 2, 8))
    metadata = TorchSDPABackend.build_metadata(batch)
    TorchSDPABackend(spec).forward(torch.randn(25, 4, 8), k, v, kv_cache, metadata)
    flat = kv_cache.view(2, -1, 2, 8)
    assert not flat[:, skipped].any()
    stored = [i for i in range(25) if i not in (3, 22)]
    torch.testing.assert_close(flat[0, batch.slot_mapping[stored]], k[stored])
    torch.testing.assert_close(flat[1, batch.slot_mapping[stored]], v[stored])
    assert int((flat[0] != 0).any(-1).any(-1).sum()) == 23


def test_check_backend_catches_a_backend_that_ignores_the_cache():
    class NoCache(TorchSDPABackend):
        name = "NO_CACHE"

        def forward(self, q, k, v, kv_cache, metadata):
            return super().forward(q, k, v, torch.zeros_like(kv_cache), metadata)

    spec = AttentionSpec(4, 2, 32, torch.float32)
    assert check_backend(NoCache, spec, "cpu", CASES["prefill"]) < 1e-5
    assert check_backend(NoCache, spec, "cpu", CASES["chunked_prefill"]) > 0.1


def test_reference_agrees_with_plain_causal_sdpa():
    q, k, v = torch.randn(3, 4, 19, 16).unbind()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)  # [19, 4, 16]
    full = reference_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), [19], [19])
    torch.testing.assert_close(full, expected)
    last = reference_attention(q.transpose(0, 1)[-3:], k.transpose(0, 1), v.transpose(0, 1), [3], [19])
    torch.testing.assert_close(last, expected[-3:])


def test_facts_and_plugin_registration(monkeypatch):
    assert (
        TorchSDPABackend.unsupported_reasons(
            AttentionSpec(8, 2, 64, torch.float16, sliding_window=4096), _CPU
        )
        == []
    )
    assert TorchSDPABackend.unsupported_reasons(AttentionSpec(8, 2, 64, torch.float64), _CPU) == [
        "dtype float64 not in float16, bfloat16, float32",
        "KV-cache dtype float64 not in float32, bfloat16, float16, float8_e4m3fn, float8_e5m2",
    ]
    features = AttentionSpec(8, 2, 64, torch.bfloat16, sliding_window=7, logits_soft_cap=5.0, has_sinks=True)
    assert TorchSDPABackend.unsupported_reasons(features, _CPU) == []
    assert torch_sdpa.PAGELLM_PLUGIN_API == "1.0"
    monkeypatch.setenv("PAGELLM_PLUGINS", "torch_sdpa")
    assert load_plugins().attention_backends == {"TORCH_SDPA": TorchSDPABackend}


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8-cache"])
def test_latent_layout_matches_reference(cache_dtype):
    """MLA-shaped: every query head against one cached row per token, V its first 32 elements."""
    spec = AttentionSpec(8, 1, 40, torch.float32, v_head_size=32, latent_kv=True, kv_cache_dtype=cache_dtype)
    assert TorchSDPABackend.layer_cache_shape(spec, 5, 16) == (1, 5, 16, 1, 40)
    assert check_backend(TorchSDPABackend, spec, "cpu", ALL_CASES) < (1e-5 if cache_dtype is None else 0.25)
