import pytest
import torch

from pagellm.attention_backends import cpu_attn
from pagellm.attention_backends.cpu_attn import CpuAttnBackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import load_plugins
from pagellm.testing.attention import check_backend, make_paged_batch

# (seq_lens, query_lens): the query tokens are the last ones of each sequence
CASES = {
    "prefill": [([17], [17]), ([33, 1, 16, 15], [33, 1, 16, 15])],
    "chunked_prefill": [([40], [8]), ([64, 33], [32, 17]), ([17, 50], [2, 16])],
    "decode": [([15, 16, 17, 32, 33, 1], [1] * 6), ([70], [1]), ([200, 3, 90, 16, 180], [1] * 5)],
    "mixed": [([40, 17, 5, 33], [8, 1, 1, 17]), ([5, 40, 6, 64], [1, 8, 1, 64]), ([50, 20, 9], [1, 20, 1])],
}
ALL_CASES = [case for cases in CASES.values() for case in cases]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


class _GPU(Platform):
    name = "testgpu"
    device_type = "cuda"


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (9, 3)], ids=["gqa", "mha", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(kind, heads, block_size):
    spec = AttentionSpec(*heads, head_size=32, dtype=torch.float32, block_size=block_size)
    assert check_backend(CpuAttnBackend, spec, "cpu", CASES[kind]) < 1e-5


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("sliding_window", [None, 7, 20, 33])
def test_dtypes_and_sliding_window(dtype, sliding_window):
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16, sliding_window=sliding_window)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < TOLERANCE[dtype]


def test_cache_dtype_differs_from_compute_dtype():
    spec = AttentionSpec(8, 2, 32, torch.bfloat16, kv_cache_dtype=torch.float32)
    assert check_backend(CpuAttnBackend, spec, "cpu", ALL_CASES) < TOLERANCE[torch.bfloat16]


def test_negative_slots_are_not_written():
    spec = AttentionSpec(4, 2, 8, torch.float32, block_size=16)
    batch = make_paged_batch([20, 5], [20, 5], 16, num_blocks=8, generator=torch.Generator().manual_seed(0))
    skipped = batch.slot_mapping[[3, 22]].clone()
    batch.slot_mapping[[3, 22]] = -1
    k, v = torch.randn(25, 2, 8), torch.randn(25, 2, 8)
    kv_cache = torch.zeros(CpuAttnBackend.kv_cache_shape(8, 16, 2, 8))
    CpuAttnBackend(spec).forward(torch.randn(25, 4, 8), k, v, kv_cache, CpuAttnBackend.build_metadata(batch))
    flat = kv_cache.view(2, 2, -1, 8).transpose(1, 2)  # [2, slots, kv_heads, d]
    assert not flat[:, skipped].any()
    stored = [i for i in range(25) if i not in (3, 22)]
    torch.testing.assert_close(flat[0, batch.slot_mapping[stored]], k[stored])
    torch.testing.assert_close(flat[1, batch.slot_mapping[stored]], v[stored])


def test_decodes_are_grouped_by_length_and_window_skips_old_blocks():
    batch = make_paged_batch([300, 20, 290, 17, 40], [1] * 5, 16)
    plan = CpuAttnBackend.build_metadata(batch).plan(None, 16, torch.float32)
    assert [g.blocks.numel() for g in plan.decodes] == [3 * 3, 2 * 19]  # {20, 17, 40} and {300, 290}
    assert plan.prefills == []
    windowed = CpuAttnBackend.build_metadata(batch).plan(32, 16, torch.float32)
    assert len(windowed.decodes) == 1 and windowed.decodes[0].blocks.numel() == 5 * 3


def test_facts_and_plugin_registration(monkeypatch):
    spec = AttentionSpec(9, 3, 64, torch.bfloat16, sliding_window=4096)
    assert CpuAttnBackend.unsupported_reasons(spec, _CPU) == []
    assert CpuAttnBackend.unsupported_reasons(spec, _GPU) == ["runs on device types cpu, not cuda"]
    assert CpuAttnBackend.kv_cache_shape(10, 16, 3, 64) == (2, 3, 10, 16, 64)
    assert cpu_attn.PAGELLM_PLUGIN_API == "1.0"
    monkeypatch.setenv("PAGELLM_PLUGINS", "cpu_attn")
    assert load_plugins().attention_backends == {"CPU_ATTN": CpuAttnBackend}


def test_decode_groups_are_bounded(monkeypatch):
    monkeypatch.setattr(cpu_attn, "DECODE_GROUP_TOKENS", 4 * 32)  # four requests of two blocks
    spec = AttentionSpec(4, 2, 16, torch.float32)
    cases = [([20, 30, 17, 25, 32, 18, 19], [1] * 7)]
    plan = CpuAttnBackend.build_metadata(make_paged_batch(*cases[0], 16)).plan(None, 16, torch.float32)
    assert [g.blocks.numel() for g in plan.decodes] == [4 * 2, 3 * 2]
    assert check_backend(CpuAttnBackend, spec, "cpu", cases) < 1e-5
