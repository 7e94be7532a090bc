"""TRITON_ATTN under the Triton interpreter on CPU tensors: the kernel reads TRITON_INTERPRET when it is
first compiled (lazily, on the first forward), so setting it here, before any forward, is enough."""

import importlib.util
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pagellm.attention_backends import triton_attn  # noqa: E402
from pagellm.attention_backends.triton_attn import TritonAttnBackend  # noqa: E402
from pagellm.core.attention import AttentionSpec  # noqa: E402
from pagellm.core.platform import Platform  # noqa: E402
from pagellm.testing.attention import check_backend  # noqa: E402

# (seq_lens, query_lens): a prefill, a chunk over cached context spanning several query tiles, decodes
MIXED = [([17, 40, 5, 33], [17, 9, 1, 1])]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class _CUDA(Platform):
    name = "testcuda"
    device_type = "cuda"


class _CPU(Platform):
    name = "testcpu"
    device_type = "cpu"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_dtypes(dtype):
    spec = AttentionSpec(8, 2, 64, dtype, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < TOLERANCE[dtype]


@pytest.mark.parametrize("head_size", [80, 96])
def test_head_sizes_padded_to_a_power_of_two(head_size):
    spec = AttentionSpec(4, 4, head_size, torch.float32, block_size=16)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < 1e-5


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes_and_boundaries(block_size):
    b = block_size
    spec = AttentionSpec(8, 1, 64, torch.float32, block_size=b)
    assert check_backend(TritonAttnBackend, spec, "cpu", [([b - 1, b + 1, 2 * b], [b - 1, 3, 1])]) < 1e-5


def test_sliding_window_with_uneven_groups():
    spec = AttentionSpec(9, 3, 64, torch.float32, block_size=16, sliding_window=7)
    assert check_backend(TritonAttnBackend, spec, "cpu", MIXED) < 1e-5


def test_kv_cache_dtype_differs():
    spec = AttentionSpec(8, 2, 64, torch.float16, kv_cache_dtype=torch.float32)
    assert check_backend(TritonAttnBackend, spec, "cpu", [([20, 5], [4, 1])]) < TOLERANCE[torch.float16]


def test_unsupported_reasons(monkeypatch):
    spec = AttentionSpec(32, 8, 128, torch.bfloat16, block_size=32, sliding_window=4096)
    assert TritonAttnBackend.unsupported_reasons(spec, _CUDA) == []
    assert TritonAttnBackend.unsupported_reasons(spec, _CPU) == ["runs on device types cuda, xpu, not cpu"]
    odd = AttentionSpec(32, 1, 72, torch.float32, block_size=8)
    assert TritonAttnBackend.unsupported_reasons(odd, _CUDA) == [
        "head size 72 not in [64, 80, 96, 128, 256]",
        "block size 8 not in [16, 32, 64]",
        "more than 16 query heads per KV head",
    ]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    assert TritonAttnBackend.unsupported_reasons(spec, _CUDA) == [
        "the triton package is not installed (pip install triton)"
    ]
    assert triton_attn.PAGELLM_PLUGIN_API == "1.0"


def test_interpreter_mode_is_read_without_triton_knobs(monkeypatch):
    """`triton.knobs` exists from Triton 3.4 on; older Tritons are read through TRITON_INTERPRET (issue 17)."""
    import triton

    monkeypatch.delattr(triton, "knobs", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_attn._interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_attn._interpreting()
