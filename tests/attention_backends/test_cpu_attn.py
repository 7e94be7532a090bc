import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pagellm.attention_backends import cpu_attn
from pagellm.attention_backends._base import store_kv
from pagellm.attention_backends.cpu_attn import _CACHE_KINDS, CpuAttnBackend
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.int8_rows import dequantize_int8_rows, quantize_int8_rows
from pagellm.core.platform import Platform
from pagellm.platforms import cpu_kernels
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_backend, make_paged_batch, reference_attention

# (seq_lens, query_lens): the query tokens are the last ones of each sequence
CASES = {
    "prefill": [([17], [17]), ([33, 1, 16, 15], [33, 1, 16, 15])],
    "chunked_prefill": [([40], [8]), ([64, 33], [32, 17]), ([17, 50], [2, 16])],
    "decode": [([15, 16, 17, 32, 33, 1], [1] * 6), ([70], [1]), ([200, 3, 90, 16, 180], [1] * 5)],
    "mixed": [([40, 17, 5, 33], [8, 1, 1, 17]), ([5, 40, 6, 64], [1, 8, 1, 64]), ([50, 20, 9], [1, 20, 1])],
}
ALL_CASES = [case for cases in CASES.values() for case in cases]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
_PLAN_SPEC = AttentionSpec(8, 2, 64, torch.float32)  # what a plan reads: window, dtype, batch_invariant


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


class _GPU(Platform):
    name = "testgpu"
    device_type = "cuda"


@pytest.fixture(params=["kernel", "kernel-no-amx", "torch"])
def decode_path(request, monkeypatch):
    """Run a test on the native decode kernel (its AMX path where the CPU has one), on its AVX-512 path, and
    on the PyTorch path it falls back to."""
    if request.param.startswith("kernel"):
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler here")
        assert cpu_kernels.load() is not None, cpu_kernels.why_unavailable()
        if request.param == "kernel-no-amx":
            if "amx" not in cpu_kernels.load().isa():
                pytest.skip("no AMX here: the kernel case already ran the same path")
            monkeypatch.setattr(CpuAttnBackend, "use_amx", False)
    else:
        monkeypatch.setattr(cpu_attn.cpu_kernels, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3)], ids=["gqa", "mha", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(kind, heads, block_size, decode_path):
    spec = AttentionSpec(*heads, head_size=32, dtype=torch.float32, block_size=block_size)
    assert check_backend(CpuAttnBackend, spec, "cpu", CASES[kind]) < 1e-5


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("sliding_window", [None, 7, 20, 33])
def test_dtypes_and_sliding_window(dtype, sliding_window, decode_path):
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16, sliding_window=sliding_window)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize(
    "heads", [(16, 1), (32, 1), (12, 4), (14, 2)], ids=["group16", "group32", "group3", "group7"]
)
@pytest.mark.parametrize("block_size", [16, 48])
def test_bf16_decode_shapes(head_size, heads, block_size, decode_path):
    """The AMX path's limits: head sizes 64 and 128, groups up to 16 query heads (32 take the AVX-512 path),
    blocks of any multiple of 16 tokens; contexts ending mid-tile and mid-block. AVX2's tiles of 8 keys
    take a group's rows four at a time for the values (7: four, then three)."""
    spec = AttentionSpec(*heads, head_size, torch.bfloat16, block_size=block_size)
    cases = [([1, 15, 16, 17, 31, 33, 100], [1] * 7), ([47, 20], [1, 20]), ([150, 70, 9], [150, 40, 1])]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < TOLERANCE[torch.bfloat16]


FEATURES = {
    "soft_cap": dict(logits_soft_cap=5.0),
    "soft_cap-scale-window": dict(logits_soft_cap=30.0, scale=0.1, sliding_window=20),
    "sinks": dict(has_sinks=True),
    "sinks-window": dict(has_sinks=True, sliding_window=7),
    "sinks-soft_cap-window": dict(has_sinks=True, logits_soft_cap=5.0, sliding_window=33),
}


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("features", list(FEATURES.values()), ids=list(FEATURES))
def test_soft_cap_and_sinks(dtype, features, decode_path):
    """Both decode paths and the prefill path: scores capped after the scale, sinks in the denominator."""
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16, **features)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize(
    "features", [FEATURES["soft_cap"], FEATURES["sinks-window"]], ids=["soft_cap", "sinks"]
)
def test_bf16_decode_shapes_with_soft_cap_and_sinks(head_size, features, decode_path):
    """The AMX path's shapes (its scores are capped and its rows normalised like the others')."""
    spec = AttentionSpec(16, 1, head_size, torch.bfloat16, block_size=32, **features)
    cases = [([1, 15, 16, 17, 31, 33, 100], [1] * 7)]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "features", [FEATURES["sinks"], FEATURES["sinks-soft_cap-window"]], ids=["sinks", "all"]
)
def test_int8_cache_with_soft_cap_and_sinks(features, decode_path):
    """Soft-cap after the key's scale, like the scale itself."""
    spec = AttentionSpec(9, 3, 64, torch.float32, kv_cache_dtype=torch.int8, **features)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < INT8_TOLERANCE


def test_cache_dtype_differs_from_compute_dtype(decode_path):
    spec = AttentionSpec(8, 2, 32, torch.bfloat16, kv_cache_dtype=torch.float32)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < TOLERANCE[torch.bfloat16]


def test_negative_slots_are_not_written():
    spec = AttentionSpec(4, 2, 8, torch.float32, block_size=16)
    batch = make_paged_batch([20, 5], [20, 5], 16, num_blocks=8, generator=torch.Generator().manual_seed(0))
    skipped = batch.slot_mapping[[3, 22]].clone()
    batch.slot_mapping[[3, 22]] = -1
    q, k, v = torch.randn(25, 4, 8), torch.randn(25, 2, 8), torch.randn(25, 2, 8)
    kv_cache = torch.zeros(CpuAttnBackend.kv_cache_shape(8, 16, 2, 8))
    out = CpuAttnBackend(spec).forward(q, k, v, kv_cache, CpuAttnBackend.build_metadata(batch))
    # uncached prefills attend over their own new k/v, the unstored tokens' included
    torch.testing.assert_close(out, reference_attention(q, k, v, [20, 5], [20, 5]))
    flat = kv_cache.view(2, 2, -1, 8).transpose(1, 2)  # [2, slots, kv_heads, d]
    assert not flat[:, skipped].any()
    stored = [i for i in range(25) if i not in (3, 22)]
    torch.testing.assert_close(flat[0, batch.slot_mapping[stored]], k[stored])
    torch.testing.assert_close(flat[1, batch.slot_mapping[stored]], v[stored])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_native_store_matches_store_kv(dtype):
    """The kernel's row copies write what `store_kv` writes, from k/v that are views of a fused qkv
    projection (rows strided), and skip negative slots."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip(f"no native kernel: {cpu_kernels.why_unavailable()}")
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch([9, 4], [9, 4], 16, num_blocks=6, generator=gen)
    batch.slot_mapping[[2, 11]] = -1
    qkv = torch.randn(13, 12 * 8 + 2 * 3 * 8, generator=gen).to(dtype)
    k, v = qkv[:, 96:120].view(13, 3, 8), qkv[:, 120:].view(13, 3, 8)
    cache = torch.randn(CpuAttnBackend.kv_cache_shape(6, 16, 3, 8), generator=gen).to(dtype)
    expected = cache.clone()
    store_kv(expected, k, v, CpuAttnBackend.build_metadata(batch), heads_first=True)
    kernels.store_kv(cache, k, v, batch.slot_mapping)
    assert torch.equal(cache, expected)
    batch.slot_mapping[0] = 6 * 16  # one past the last slot
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.store_kv(cache, k, v, batch.slot_mapping)


def test_backend_stores_through_the_kernel_only_where_dtypes_match(monkeypatch):
    """Same-dtype caches take the kernel's copy; an int8 cache quantizes through `store_kv`."""
    if cpu_kernels.load() is None:
        pytest.skip(f"no native kernel: {cpu_kernels.why_unavailable()}")
    calls = []
    monkeypatch.setattr(cpu_attn, "store_kv", lambda *args, **kwargs: calls.append("python"))
    batch = make_paged_batch([5], [5], 16, num_blocks=2, generator=torch.Generator().manual_seed(0))
    k = torch.randn(5, 2, 8).bfloat16()
    for cache_dtype, expected in ((torch.bfloat16, []), (torch.int8, ["python"])):
        spec = AttentionSpec(4, 2, 8, torch.bfloat16, block_size=16, kv_cache_dtype=cache_dtype)
        backend = CpuAttnBackend(spec)
        shape = list(CpuAttnBackend.kv_cache_shape(2, 16, 2, 8))
        shape[-1] += 4 if cache_dtype == torch.int8 else 0
        cache = torch.zeros(shape, dtype=cache_dtype)
        calls.clear()
        backend._store(cache, k, k, CpuAttnBackend.build_metadata(batch))
        assert calls == expected
        assert cache.any() == (cache_dtype == torch.bfloat16)


@pytest.mark.parametrize(
    "seq_lens",
    [
        pytest.param([3000], id="one", marks=pytest.mark.slow),
        pytest.param([2500, 40], id="two"),
        pytest.param([700] * 3, id="three", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("sliding_window", [pytest.param(None, marks=pytest.mark.slow), 300])
def test_long_contexts_split_across_threads(seq_lens, sliding_window, decode_path):
    spec = AttentionSpec(9, 3, 64, torch.bfloat16, block_size=16, sliding_window=sliding_window)
    cases = [(seq_lens, [1] * len(seq_lens)), ([*seq_lens, 40], [1] * len(seq_lens) + [40])]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "features",
    [FEATURES["sinks"], pytest.param(FEATURES["sinks-soft_cap-window"], marks=pytest.mark.slow)],
    ids=["sinks", "all"],
)
def test_split_contexts_count_the_sink_once(features, monkeypatch, decode_path):
    """The kernel splits the long context into partitions (375 tokens, rounded up to 384: four of them)
    and merges them with the sink joining the denominator once, not once per partition."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    spec = AttentionSpec(8, 2, 64, torch.float32, block_size=16, **features)
    batch = make_paged_batch([1500, 40], [1, 1], 16)
    assert CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, True, 2).partition == 375
    assert check_backend(CpuAttnBackend, spec, "cpu", [([1500, 40], [1, 1]), ([1500], [1])]) < 1e-5


@pytest.mark.parametrize("features", [{}, FEATURES["sinks-window"]], ids=["plain", "sinks-window"])
def test_prefill_blocks_merge_across_partitions(features, monkeypatch, decode_path):
    """The kernel's blocks of a prefill chunk's query tokens over contexts split into partitions (the plan
    keeps a step with chunks whole, but the kernel takes any partition): a partition past a block's last
    token sees nothing, and the merge finds each row's block."""
    monkeypatch.setattr(cpu_attn, "_partition", lambda *args: 48)
    spec = AttentionSpec(12, 4, 64, torch.bfloat16, block_size=16, **features)
    cases = [([150, 70, 9], [150, 40, 1]), ([200], [3]), ([100, 120], [1, 1])]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < TOLERANCE[torch.bfloat16]


class _Layer:
    """What `pagellm::attention` and `begin_forward` read of an attention layer: the backend, `attend`,
    its sinks."""

    def __init__(self, impl, sinks=None):
        self.impl = impl
        self.sinks = sinks

    def attend(self, q, k, v, ctx):
        s = self.impl.spec
        shape = (s.num_heads, s.num_kv_heads, s.num_kv_heads)
        q, k, v = (t.view(-1, n, s.head_size) for t, n in zip((q, k, v), shape, strict=True))
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.impl.forward(q, k, v, ctx.kv_caches[0], ctx.metadata, **extra)
        return out.reshape(-1, s.num_heads * s.head_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("features", [{}, FEATURES["sinks-soft_cap-window"]], ids=["plain", "sinks-soft_cap"])
def test_compiled_graphs_op_runs_decode_steps_natively(dtype, features, monkeypatch):
    """pagellm::cpu_attention (what compiled graphs call) gives the Python path's output and cache for
    decode-only steps, which it runs in C++ (no Python call), and for steps with prefill chunks where those
    go to the kernel too (AMX); other steps, and calls outside a forward, go through pagellm::attention."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    from pagellm.models.context import set_forward_context
    from pagellm.models.layers import attention  # noqa: F401  (defines pagellm::attention)

    spec = AttentionSpec(9, 3, 64, dtype, block_size=16, **features)
    impl = CpuAttnBackend(spec)
    sinks = torch.randn(9) * 2 if spec.has_sinks else None
    assert impl.graph_op is torch.ops.pagellm.cpu_attention.default
    python_calls = []
    real_forward = CpuAttnBackend.forward
    monkeypatch.setattr(
        CpuAttnBackend, "forward", lambda *a, **kw: python_calls.append(1) or real_forward(*a, **kw)
    )
    gen = torch.Generator().manual_seed(0)
    for seq_lens, query_lens, native in (([40, 70, 17], [1, 1, 1], True), ([40, 70], [1, 9], False)):
        batch = make_paged_batch(seq_lens, query_lens, 16, num_blocks=16, generator=gen)
        tokens = sum(query_lens)
        q = torch.randn(tokens, 9 * 64, generator=gen).to(dtype)
        kv = torch.randn(tokens, 2 * 3 * 64, generator=gen).to(dtype)  # k and v: strided views, as in a graph
        k, v = kv[:, : 3 * 64], kv[:, 3 * 64 :]
        cache = torch.randn(CpuAttnBackend.kv_cache_shape(16, 16, 3, 64), generator=gen).to(dtype)
        expected_cache = cache.clone()
        layer = _Layer(impl, sinks)
        expected = layer.attend(q, k, v, _Ctx([expected_cache], CpuAttnBackend.build_metadata(batch)))
        python_calls.clear()
        with set_forward_context(CpuAttnBackend.build_metadata(batch), [cache], [layer]):
            out = torch.ops.pagellm.cpu_attention(q, k, v, torch.tensor(0))
        assert python_calls == ([] if native or impl.prefills_on_kernel else [1])
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert torch.equal(cache, expected_cache)
    # a pipeline stage's layers (None where another stage holds one) keep the Python op
    metadata = CpuAttnBackend.build_metadata(batch)
    metadata.begin_forward([torch.empty(0), cache], [None, _Layer(impl)])
    assert metadata.native is None
    # after the forward, the op holds nothing of it: a call outside one reaches the Python op, which says so
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        torch.ops.pagellm.cpu_attention(q, k, v, torch.tensor(0))


class _Ctx:
    def __init__(self, kv_caches, metadata):
        self.kv_caches, self.metadata = kv_caches, metadata


def test_kernel_plan_lists_decodes_and_splits_long_contexts(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    batch = make_paged_batch([3000, 20, 5], [1, 1, 5], 16)
    plan = CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, True, 1)
    assert plan.kernel_reqs.tolist() == [0, 1] and plan.decodes == [] and len(plan.prefills) == 1
    assert plan.partition == 750  # 2 requests x 1 KV head, 8 items wanted: each context in 4 parts
    busy = make_paged_batch([300] * 8, [1] * 8, 16)
    assert CpuAttnBackend.build_metadata(busy).plan(_PLAN_SPEC, 16, True, 1).partition == 300
    invariant = dataclasses.replace(_PLAN_SPEC, batch_invariant=True)
    plan = CpuAttnBackend.build_metadata(batch).plan(invariant, 16, True, 1)
    assert plan.kernel_reqs.tolist() == [0, 1, 2] and plan.prefills == [] and plan.partition == 3000  # whole
    # prefill chunks on the kernel (AMX): every request there, contexts whole (the chunk's query blocks
    # are the work items that keep the threads busy)
    plan = CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, True, 1, prefills_on_kernel=True)
    assert plan.kernel_reqs.tolist() == [0, 1, 2] and plan.prefills == [] and plan.partition == 3000
    plan = CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, False, 1, prefills_on_kernel=True)
    assert plan.kernel_reqs is None and len(plan.prefills) == 1  # no kernel: torch's fused kernel


def test_a_prefill_that_stores_nothing_attends_over_its_own_keys(decode_path):
    """A dummy step (slots -1, as the compile check's) stores no key: its prefill reads its new k/v, not
    the cache the kernel would read."""
    spec = AttentionSpec(9, 3, 64, torch.bfloat16, block_size=16)
    impl = CpuAttnBackend(spec)
    batch = make_paged_batch([40], [40], 16)
    batch = dataclasses.replace(batch, slot_mapping=torch.full_like(batch.slot_mapping, -1))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, n, 64, generator=gen).bfloat16() for n in (9, 3, 3))
    cache = torch.full(CpuAttnBackend.kv_cache_shape(4, 16, 3, 64), float("nan"), dtype=torch.bfloat16)
    out = impl.forward(q, k, v, cache, CpuAttnBackend.build_metadata(batch))
    assert cache.isnan().all()  # nothing stored
    expected = reference_attention(q, k, v, [40], [40])
    assert (out.float() - expected).abs().max() < TOLERANCE[torch.bfloat16]


def test_prefills_go_to_the_kernel_where_it_multiplies_tiles(monkeypatch):
    """AMX tiles, or AVX-512 BF16's pair tiles (a build without them: torch's fused kernel)."""
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip(cpu_kernels.why_unavailable())
    tiles = "amx" in kernel.isa() or kernel.attention_pair_tiles()
    bf16 = AttentionSpec(9, 3, 64, torch.bfloat16, block_size=16)
    assert CpuAttnBackend(bf16).prefills_on_kernel == tiles
    for other in (
        dataclasses.replace(bf16, dtype=torch.float32),
        dataclasses.replace(bf16, kv_cache_dtype=torch.int8),
        dataclasses.replace(bf16, head_size=32),
        dataclasses.replace(bf16, num_heads=32, num_kv_heads=1),  # 32 query heads a KV head: not one tile
    ):
        assert not CpuAttnBackend(other).prefills_on_kernel
    monkeypatch.setattr(CpuAttnBackend, "use_amx", False)
    assert CpuAttnBackend(bf16).prefills_on_kernel == kernel.attention_pair_tiles()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prefill_tokens_row_does_not_depend_on_its_chunk(dtype):
    """The kernel's prefill rows (AMX or pair tiles where the build has them, else its vector path) are the
    same bits whether a token's chunk starts at the prompt's start or later: a block of the chunk's rows
    ends its keys at its own last row, so a key in a whole tile of one block may be in the last, short tile
    of another."""
    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.skip(cpu_kernels.why_unavailable())
    gen = torch.Generator().manual_seed(0)
    length, blocks = 70, 5
    q = torch.randn(length, 9, 64, generator=gen).to(dtype)
    cache = torch.randn(2, 3, blocks + 1, 16, 64, generator=gen).to(dtype)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    rows = []
    for start in (0, 21, 50):  # the chunk [start, length) of the prompt, its earlier keys in the cache
        out = torch.empty(length - start, 9, 64, dtype=dtype)
        kernel.paged_attention(
            out,
            q[start:].contiguous(),
            cache[0],
            cache[1],
            table,
            torch.tensor([length], dtype=torch.int32),
            torch.tensor([0, length - start], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            _CACHE_KINDS[dtype],
            0.125,
            0,
            length,
            True,
            0.0,
            None,
            False,
        )
        rows.append(out[-20:])
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


@pytest.mark.slow
def test_fallback_when_the_kernel_cannot_be_built(tmp_path):
    """No compiler (or PAGELLM_CPU_KERNELS=0): one warning saying why, and the PyTorch path's results."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from pagellm.attention_backends.cpu_attn import CpuAttnBackend\n"
        "from pagellm.core.attention import AttentionSpec\n"
        "from pagellm.testing.attention import check_backend\n"
        "spec = AttentionSpec(8, 2, 32, torch.float32)\n"
        "assert CpuAttnBackend(spec).kernel is None\n"
        "print(check_backend(CpuAttnBackend, spec, 'cpu', [([40, 17], [1, 1])]))\n"
    )
    for env in ({"CXX": str(tmp_path / "no-such-compiler")}, {"PAGELLM_CPU_KERNELS": "0"}):
        run = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PAGELLM_CACHE_DIR": str(tmp_path), **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        assert float(run.stdout) < 1e-5
        why = "no C++ compiler" if "CXX" in env else "PAGELLM_CPU_KERNELS=0"
        assert "CPU kernels unavailable (attention uses its PyTorch path" in run.stderr and why in run.stderr


def test_decodes_are_grouped_by_length_and_window_skips_old_blocks():
    batch = make_paged_batch([300, 20, 290, 17, 40], [1] * 5, 16)
    plan = CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, False, 1)
    assert [g.blocks.numel() for g in plan.decodes] == [3 * 3, 2 * 19]  # {20, 17, 40} and {300, 290}
    assert plan.prefills == []
    windowed = CpuAttnBackend.build_metadata(batch).plan(
        dataclasses.replace(_PLAN_SPEC, sliding_window=32), 16, False, 1
    )
    assert len(windowed.decodes) == 1 and windowed.decodes[0].blocks.numel() == 5 * 3


def test_facts_and_plugin_registration(monkeypatch):
    spec = AttentionSpec(9, 3, 64, torch.bfloat16, sliding_window=4096, logits_soft_cap=30.0, has_sinks=True)
    assert CpuAttnBackend.unsupported_reasons(spec, _CPU) == []
    assert CpuAttnBackend.unsupported_reasons(spec, _GPU) == ["runs on device types cpu, not cuda"]
    assert CpuAttnBackend.kv_cache_shape(10, 16, 3, 64) == (2, 3, 10, 16, 64)
    assert cpu_attn.PAGELLM_PLUGIN_API == "1.0"
    monkeypatch.setenv("PAGELLM_PLUGINS", "cpu_attn")
    assert load_plugins().attention_backends == {"CPU_ATTN": CpuAttnBackend}


def test_decode_groups_are_bounded(monkeypatch):
    monkeypatch.setattr(cpu_attn, "DECODE_GROUP_TOKENS", 4 * 32)  # four requests of two blocks
    monkeypatch.setattr(cpu_attn.cpu_kernels, "load", lambda: None)
    spec = AttentionSpec(4, 2, 16, torch.float32)
    cases = [([20, 30, 17, 25, 32, 18, 19], [1] * 7)]
    batch = make_paged_batch(*cases[0], 16)
    plan = CpuAttnBackend.build_metadata(batch).plan(_PLAN_SPEC, 16, False, 2)
    assert [g.blocks.numel() for g in plan.decodes] == [4 * 2, 3 * 2]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_matches_the_reference_backend(cache_dtype, decode_path):
    """A one-byte cache rounds K/V the same way in every backend: CPU_ATTN (both paths) gives what
    TORCH_SDPA gives on the same rounded cache, to bfloat16 precision."""
    spec = AttentionSpec(8, 2, 64, torch.bfloat16, kv_cache_dtype=cache_dtype)
    batch = make_paged_batch([40, 17, 300, 33], [8, 1, 1, 17], 16, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, 8, 64, generator=gen).bfloat16()
    k, v = (torch.randn(batch.num_tokens, 2, 64, generator=gen).bfloat16() for _ in range(2))
    num_blocks = int(batch.block_tables.max()) + 1
    context = torch.randn(2, num_blocks * 16, 2, 64, generator=gen).to(cache_dtype)  # the cached tokens
    sdpa_cache = context.view(2, num_blocks, 16, 2, 64).clone()
    cpu_cache = context.view(2, num_blocks, 16, 2, 64).permute(0, 3, 1, 2, 4).contiguous()
    expected = TorchSDPABackend(spec).forward(q, k, v, sdpa_cache, TorchSDPABackend.build_metadata(batch))
    out = CpuAttnBackend(spec).forward(q, k, v, cpu_cache, CpuAttnBackend.build_metadata(batch))
    assert cpu_cache.dtype == cache_dtype
    torch.testing.assert_close(cpu_cache.permute(0, 2, 3, 1, 4).float(), sdpa_cache.float())
    assert (out.float() - expected.float()).abs().max() < TOLERANCE[torch.bfloat16]


INT8_TOLERANCE = 0.06  # K/V rounded to max |x| / 254 per row; the same bound as the conformance suite's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_int8_cache_stays_close_to_the_reference(dtype, sliding_window, decode_path):
    spec = AttentionSpec(9, 3, 64, dtype, kv_cache_dtype=torch.int8, sliding_window=sliding_window)
    assert spec.cache_row_size == 64 + 4
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < INT8_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_cache_kernel_reads_scales_like_the_pytorch_path(dtype, monkeypatch):
    """Both paths read one int8 cache whose rows have very different scales: the kernel must agree with
    the PyTorch path run in float32 on the same inputs (the reference for the bfloat16 kernel too, whose
    keys go through another instruction path), so a misplaced key or value scale cannot hide inside the
    int8 tolerance."""
    if cpu_kernels.load() is None:
        pytest.skip(cpu_kernels.why_unavailable())
    spec = AttentionSpec(9, 3, 64, dtype, kv_cache_dtype=torch.int8)
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch([40, 17, 300, 33, 1500], [1] * 5, 16, generator=gen)  # decodes: the kernel
    num_blocks = int(batch.block_tables.max()) + 1
    magnitudes = torch.exp(torch.randn(2, 3, num_blocks, 16, 1, generator=gen))  # 0.1x to 10x
    context = torch.randn(2, 3, num_blocks, 16, 64, generator=gen) * magnitudes
    cache = quantize_int8_rows(context).view(torch.int8)
    q = torch.randn(batch.num_tokens, 9, 64, generator=gen).to(dtype)
    k, v = (torch.randn(batch.num_tokens, 3, 64, generator=gen).to(dtype) for _ in range(2))
    kernel_cache = cache.clone()
    out = CpuAttnBackend(spec).forward(q, k, v, kernel_cache, CpuAttnBackend.build_metadata(batch))
    monkeypatch.setattr(cpu_attn.cpu_kernels, "load", lambda: None)
    fp32 = AttentionSpec(9, 3, 64, torch.float32, kv_cache_dtype=torch.int8)
    q, k, v = q.float(), k.float(), v.float()
    expected = CpuAttnBackend(fp32).forward(q, k, v, cache, CpuAttnBackend.build_metadata(batch))
    assert torch.equal(kernel_cache, cache)  # both stored the new rows identically
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # float32 sums in another order; bfloat16 output
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_int8_rows_round_trip():
    x = torch.randn(50, 3, 64) * torch.exp(torch.randn(50, 3, 1) * 3)
    x[7, 1] = 0
    rows = quantize_int8_rows(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.uint8
    back = dequantize_int8_rows(rows, torch.float32)
    assert torch.all((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 254 + 1e-6)
    assert not back[7, 1].any()


LATENT = dict(num_heads=8, num_kv_heads=1, head_size=40, v_head_size=32, latent_kv=True)
"""MLA-shaped: every query head against one cached row per token, V its first 32 elements."""


@pytest.mark.parametrize(
    "dtype, cache_dtype, tolerance",
    [
        (torch.float32, None, 1e-5),
        (torch.bfloat16, None, TOLERANCE[torch.bfloat16]),
        (torch.float32, torch.int8, INT8_TOLERANCE),
        (torch.float32, torch.float8_e4m3fn, 0.25),
    ],
    ids=["fp32", "bf16", "int8-cache", "fp8-cache"],
)
def test_latent_layout_matches_reference(dtype, cache_dtype, tolerance):
    """The latent layout keeps one row per token and runs the PyTorch path (no native kernel for it): in
    every cache dtype, with sinks (explicit attention: V narrower than K) and a window."""
    spec = AttentionSpec(**LATENT, dtype=dtype, kv_cache_dtype=cache_dtype)
    assert CpuAttnBackend.layer_cache_shape(spec, 5, 16) == (1, 1, 5, 16, spec.cache_row_size)
    assert CpuAttnBackend(spec).kernel is None and CpuAttnBackend(spec).graph_op is None
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < tolerance
    windowed = AttentionSpec(
        **LATENT, dtype=dtype, kv_cache_dtype=cache_dtype, sliding_window=20, has_sinks=True
    )
    assert check_backend(CpuAttnBackend, windowed, "cpu", CASES["mixed"]) < tolerance


INVARIANT_SPECS = {
    "bf16": dict(dtype=torch.bfloat16),
    "fp32": dict(dtype=torch.float32),
    "bf16-window-sinks-cap": dict(
        dtype=torch.bfloat16, sliding_window=20, has_sinks=True, logits_soft_cap=30.0
    ),
    "bf16-int8-cache": dict(dtype=torch.bfloat16, kv_cache_dtype=torch.int8),
}


@pytest.mark.parametrize("features", list(INVARIANT_SPECS.values()), ids=list(INVARIANT_SPECS))
def test_batch_invariant_matches_reference(features, decode_path):
    if decode_path == "torch":
        pytest.skip("batch-invariant specs need the native kernel")
    spec = AttentionSpec(9, 3, 64, block_size=16, batch_invariant=True, **features)
    tolerance = INT8_TOLERANCE if spec.cache_dtype == torch.int8 else TOLERANCE[spec.dtype]
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < tolerance


def _subject_rows(spec: AttentionSpec, schedule: list, threads: int = 2) -> torch.Tensor:
    """Run `schedule` (steps of (request, seq_len, query_len); request 0 is the subject, of 75 tokens,
    1 and 2 fillers with 600 and 300 tokens of random cache) and return the subject's output rows, one per
    position, each from the step that queried it."""
    block_size, length = spec.block_size, 75
    gen = torch.Generator().manual_seed(0)
    num_blocks = 70
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(3, 38, dtype=torch.int32)
    for row, blocks in enumerate((5, 38, 19)):
        tables[row, :blocks] = torch.tensor(ids[:blocks], dtype=torch.int32)
        ids = ids[blocks:]
    backend = CpuAttnBackend(spec)
    cache = torch.randn(backend.layer_cache_shape(spec, num_blocks, block_size), generator=gen)
    if spec.cache_dtype == torch.int8:  # whole rows with their scales
        cache = quantize_int8_rows(cache[..., : spec.head_size])
    cache = cache.to(spec.cache_dtype)
    q = torch.randn(length, spec.num_heads, spec.head_size, generator=gen).to(spec.dtype)
    kv = torch.randn(2, length, spec.num_kv_heads, spec.head_size, generator=gen).to(spec.dtype)
    sinks = torch.randn(spec.num_heads, generator=gen) if spec.has_sinks else None
    out = torch.full((length, spec.num_heads, spec.head_size), float("nan"), dtype=spec.dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for step in schedule:
            reqs, seq_lens, query_lens = zip(*step, strict=True)
            batch = make_paged_batch(seq_lens, query_lens, block_size, block_tables=tables[list(reqs)])
            parts, rows = [[], [], []], []
            for req, seq_len, query_len in step:
                if req == 0:
                    positions = slice(seq_len - query_len, seq_len)
                    (
                        parts[0].append(q[positions]),
                        parts[1].append(kv[0, positions]),
                        parts[2].append(kv[1, positions]),
                    )
                    rows.append((len(torch.cat(parts[0])) - query_len, positions))
                else:
                    parts[0].append(
                        torch.randn(query_len, spec.num_heads, spec.head_size, generator=gen).to(spec.dtype)
                    )
                    for i in (1, 2):
                        parts[i].append(
                            torch.randn(query_len, spec.num_kv_heads, spec.head_size, generator=gen).to(
                                spec.dtype
                            )
                        )
            args = [torch.cat(p) for p in parts]
            result = backend.forward(*args, cache, CpuAttnBackend.build_metadata(batch), sinks=sinks)
            for start, positions in rows:
                out[positions] = result[start : start + positions.stop - positions.start]
    finally:
        torch.set_num_threads(threads)
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("features", list(INVARIANT_SPECS.values()), ids=list(INVARIANT_SPECS))
def test_batch_invariant_rows_do_not_depend_on_the_step(features):
    """A token's output is the same bits whether it was queried in one whole prefill, in a prefill chunk
    beside a long decode and another prefill, or as a decode alone or among long-context decodes (which
    the default plan splits across threads)."""
    assert cpu_kernels.load() is not None, cpu_kernels.why_unavailable()
    spec = AttentionSpec(9, 3, 64, block_size=16, batch_invariant=True, **features)
    whole = _subject_rows(spec, [[(0, 75, 75)]])
    chunked = _subject_rows(
        spec,
        [[(0, 20, 20)], [(1, 600, 1), (0, 45, 25), (2, 300, 17)]] + [[(0, p + 1, 1)] for p in range(45, 75)],
    )
    decodes = _subject_rows(
        spec,
        [[(0, 10, 10), (1, 600, 1)]] + [[(1, 600, 1), (0, p + 1, 1), (2, 300, 1)] for p in range(10, 75)],
    )
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, decodes)
