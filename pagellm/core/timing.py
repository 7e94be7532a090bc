"""`time_backend`: the selector's timer (`pagellm.core.selector`), one attention layer of a typical step on
the model's real shapes.

A step is one prefill chunk plus one decode batch. Only `forward` is timed: `build_metadata` runs once
per step and is shared by all layers, so its cost is small beside theirs. Each call times one step; the
inputs are built on a backend's first call (the selector's untimed one), so the selector can time the
candidates in interleaved rounds, where a burst of other work slows all of them alike.

`CpuLoad` says how much of the machine other processes used over the timings: a busy machine's timings are
neither trusted nor cached (a start beside a build had timed CPU_ATTN 5x slower than TORCH_SDPA, the next
start, alone, 2x faster, and the first pick was cached for every later start).
"""

from __future__ import annotations

import os
import time

import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.int8_rows import quantize_int8_rows
from pagellm.core.platform import Platform
from pagellm.core.synthetic import blocks_needed, make_paged_batch

PREFILL_TOKENS = 512
DECODE_REQUESTS = 32
DECODE_CONTEXT = 512


def time_backend(backend: type[AttentionBackend], spec: AttentionSpec, platform: type[Platform]) -> float:
    """Seconds of one layer's forward over a 512-token prefill chunk plus a 32-request decode batch with 512
    tokens of context each (the inputs built on the first call for these shapes, whose time includes
    whatever the backend compiles on first use: the selector does not count it)."""
    key = (backend, spec, platform)
    if key not in _prepared:
        _prepared[key] = _prepare(backend, spec, platform)
    return _run(platform, *_prepared[key])


_prepared: dict = {}
"""The candidates' inputs while the selector times them; `release()` frees them (tens of MB each)."""


def release() -> None:
    _prepared.clear()


def _prepare(backend: type[AttentionBackend], spec: AttentionSpec, platform: type[Platform]):
    device = platform.device()
    seq_lens = [PREFILL_TOKENS] + [DECODE_CONTEXT + 1] * DECODE_REQUESTS
    num_blocks = blocks_needed(seq_lens, spec.block_size)
    gen = torch.Generator().manual_seed(0)
    shape = backend.layer_cache_shape(spec, num_blocks, spec.block_size)
    if spec.cache_dtype == torch.int8:  # rows with their scales, as the store writes them
        values = torch.randn(*shape[:-1], spec.head_size, generator=gen)
        kv_cache = quantize_int8_rows(values).view(torch.int8).to(device)
    else:
        kv_cache = torch.randn(shape, generator=gen).to(device, spec.cache_dtype)
    prefill = make_paged_batch(seq_lens[:1], seq_lens[:1], spec.block_size, num_blocks, device, generator=gen)
    decode = make_paged_batch(
        seq_lens[1:], [1] * DECODE_REQUESTS, spec.block_size, num_blocks, device, generator=gen
    )
    steps = []
    for batch in (prefill, decode):
        tokens = batch.num_tokens
        q = torch.randn(tokens, spec.num_heads, spec.head_size, generator=gen).to(device, spec.dtype)
        k = torch.randn(tokens, spec.num_kv_heads, spec.head_size, generator=gen).to(device, spec.dtype)
        v = torch.randn(tokens, spec.num_kv_heads, spec.head_size, generator=gen).to(device, spec.dtype)
        if spec.latent_kv:  # V is the first v_size elements of K's row (MLA)
            v = k[..., : spec.v_size]
        steps.append((q, k, v, backend.build_metadata(batch)))
    return backend(spec), kv_cache, steps


def _run(platform: type[Platform], impl, kv_cache: torch.Tensor, steps) -> float:
    with torch.inference_mode():
        platform.synchronize()
        start = time.perf_counter()
        for q, k, v, metadata in steps:
            impl.forward(q, k, v, kv_cache, metadata)
        platform.synchronize()
        return time.perf_counter() - start


class CpuLoad:
    """From its creation to `others()`: the share of the machine's CPU time that other processes used (0 to
    1), from /proc/stat's busy time less this process's own; None where /proc/stat cannot be read."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal, in seconds
        own = sum(os.times()[:2])
        return time.monotonic(), busy, own

    def others(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        if wall <= 0:
            return 0.0
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, min(1.0, others / (wall * (os.cpu_count() or 1))))
