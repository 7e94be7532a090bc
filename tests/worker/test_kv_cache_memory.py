"""The CPU KV cache costs memory as it fills, not at start-up (worker/kv_cache.py `zeroed`): the tensor reads
as zeros everywhere, and allocating 1 GiB of it leaves the process's resident memory where it was."""

from __future__ import annotations

import os

import torch

from pagellm.worker.kv_cache import zeroed


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_cache_is_zeros_and_takes_memory_only_where_written():
    before = resident_bytes()
    cache = zeroed((2, 8192, 16, 2, 1024), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert cache.shape == (2, 8192, 16, 2, 1024) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert resident_bytes() - before < 64 * 2**20
    cache[1, 5].fill_(2.5)
    assert float(cache[1, 5].float().mean()) == 2.5
    assert not bool(cache[0].any()) and not bool(cache[1, 6:].any())  # reading maps the shared zero page


def test_an_empty_shape_and_other_dtypes():
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
    small = zeroed((3, 5), torch.float8_e4m3fn, torch.device("cpu"))
    assert small.float().abs().sum() == 0
