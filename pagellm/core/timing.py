"""`time_backend`: the selector's timer (`pagellm.core.selector`), one attention layer of a typical step on
the model's real shapes.

A step is one prefill chunk plus one decode batch. Only `forward` is timed: `build_metadata` runs once
per step and is shared by all layers, so its cost is small beside theirs.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.int8_rows import quantize_int8_rows
from pagellm.core.platform import Platform
from pagellm.core.synthetic import blocks_needed, make_paged_batch

PREFILL_TOKENS = 512
DECODE_REQUESTS = 32
DECODE_CONTEXT = 512
WARMUP = 1
REPEATS = 3


def time_backend(backend: type[AttentionBackend], spec: AttentionSpec, platform: type[Platform]) -> float:
    """Median seconds of one layer's forward over a 512-token prefill chunk plus a 32-request decode batch
    with 512 tokens of context each, after a warm-up."""
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
    impl = backend(spec)
    times = []
    with torch.inference_mode():
        for i in range(WARMUP + REPEATS):
            platform.synchronize()
            start = time.perf_counter()
            for q, k, v, metadata in steps:
                impl.forward(q, k, v, kv_cache, metadata)
            platform.synchronize()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
    return statistics.median(times)
