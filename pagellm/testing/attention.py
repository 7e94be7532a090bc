"""Attention test helpers: random paged batches (from the runtime's `pagellm.core.synthetic`), a plain reference, and a
conformance check for backends.

Any backend, ours or a vendor's, is checked the same way: `check_backend(MyBackend, spec, device, cases)`
returns the largest difference from `reference_attention`; the caller picks the tolerance for the dtype.
`check_layers` does the same for several layers of different specs (windows, soft-caps, sinks, latent
K/V) run in the same steps over one shared metadata, as a model's layers are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.synthetic import blocks_needed, make_paged_batch

__all__ = ["blocks_needed", "check_backend", "check_layers", "make_paged_batch", "reference_attention"]


def reference_attention(
    q: torch.Tensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    sliding_window: int | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Plain causal attention per sequence in float32, no paging: the answer every backend must give.

    q: [sum(query_lens), H, d], each request's query tokens in order; k_full: [sum(seq_lens), KV, d], v_full:
    [sum(seq_lens), KV, dv], each request's whole sequence in order; sinks: [H] logits that join every softmax and add no value
    (transformers' GPT-OSS eager attention); attention_chunk: a query sees only keys of its own chunk of that
    many positions (transformers' chunked causal mask, Llama 4). Scores are scaled, then capped, then masked. Returns float32
    [sum(query_lens), H, dv]."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    group = q.shape[1] // k_full.shape[1]
    outs, q_start, kv_start = [], 0, 0
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        qi = q[q_start : q_start + query_len].float().transpose(0, 1)  # [H, Q, d]
        ki = k_full[kv_start : kv_start + seq_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v_full[kv_start : kv_start + seq_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(-1, -2) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        query_pos, key_pos = (
            torch.arange(seq_len - query_len, seq_len)[:, None],
            torch.arange(seq_len)[None, :],
        )
        diff = query_pos - key_pos
        visible = diff >= 0
        if sliding_window is not None:
            visible &= diff < sliding_window
        if attention_chunk is not None:
            visible &= query_pos // attention_chunk == key_pos // attention_chunk
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        if sinks is not None:  # a column of the head's sink logit, dropped after the softmax
            column = sinks.float().to(scores.device).view(-1, 1, 1).expand(-1, query_len, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ vi).transpose(0, 1))
        q_start += query_len
        kv_start += seq_len
    return torch.cat(outs)


def check_backend(
    backend_cls: type[AttentionBackend],
    spec: AttentionSpec,
    device: torch.device | str,
    cases: Sequence[tuple[Sequence[int], Sequence[int]]],
    seed: int = 0,
) -> float:
    """Largest absolute difference between the backend and `reference_attention` over `cases`.

    Each case is (seq_lens, query_lens). The cached part of every sequence is first written by the
    backend's own forward, as one prefill step over it (whose output is checked too); then the case's step
    runs with the same block tables, so the backend's cache layout is its own business. A spec with
    `has_sinks` gets random sink logits (float32 [num_heads]), passed to `forward` as `sinks`; a `latent_kv`
    spec gets V as the first v_size elements of K (MLA's latent row), as the model hands it over."""
    return max(check_layers(backend_cls, [spec], device, cases, seed))


def check_layers(
    backend_cls: type[AttentionBackend],
    specs: Sequence[AttentionSpec],
    device: torch.device | str,
    cases: Sequence[tuple[Sequence[int], Sequence[int]]],
    seed: int = 0,
) -> list[float]:
    """`check_backend` for a model of several layers, one per spec (all of one block size): every step's
    metadata is built once and shared by the layers, each with its own inputs, cache and sinks, as the
    model runner does; returns each layer's largest difference from the reference."""
    block_size = specs[0].block_size
    if any(spec.block_size != block_size for spec in specs):
        raise ValueError("the layers of one step share its block tables: give every spec one block size")
    worst = [0.0] * len(specs)
    for case, (seq_lens, query_lens) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + case)
        total = sum(seq_lens)
        num_blocks = blocks_needed(seq_lens, block_size)
        layers = []
        for i, spec in enumerate(specs):
            q = torch.randn(total, spec.num_heads, spec.head_size, generator=gen).to(device, spec.dtype)
            k = torch.randn(total, spec.num_kv_heads, spec.head_size, generator=gen).to(device, spec.dtype)
            v = torch.randn(total, spec.num_kv_heads, spec.head_size, generator=gen).to(device, spec.dtype)
            if spec.latent_kv:  # V is the first v_size elements of K's row
                v = k[..., : spec.v_size]
            if i == 0:  # one layer draws what check_backend always drew, in that order
                batch = make_paged_batch(seq_lens, query_lens, block_size, num_blocks, device, generator=gen)
            shape = backend_cls.layer_cache_shape(spec, num_blocks, block_size)
            kv_cache = torch.zeros(shape, dtype=spec.cache_dtype, device=device)
            layers.append([spec, backend_cls(spec), q, k, v, kv_cache, None])
        for layer in layers:  # sinks of a few units, as trained ones are: some heads mostly sink
            if layer[0].has_sinks:
                layer[6] = (torch.randn(layer[0].num_heads, generator=gen) * 2 + 1).to(device)
        starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
        cached = [s - n for s, n in zip(seq_lens, query_lens, strict=True)]
        rows = [i for i, n in enumerate(cached) if n]
        steps = []
        if rows:
            lens = [cached[i] for i in rows]
            tables = batch.block_tables[rows]
            prefill = make_paged_batch(lens, lens, block_size, device=device, block_tables=tables)
            steps.append((prefill, [starts[i] for i in rows], lens, lens))
        steps.append((batch, starts, list(seq_lens), list(query_lens)))
        for step, step_starts, step_seq_lens, step_query_lens in steps:
            queries, context = [], []
            for start, seq_len, query_len in zip(step_starts, step_seq_lens, step_query_lens, strict=True):
                queries += range(start + seq_len - query_len, start + seq_len)
                context += range(start, start + seq_len)
            queries, context = torch.tensor(queries, device=device), torch.tensor(context, device=device)
            metadata = backend_cls.build_metadata(step)
            for i, (spec, impl, q, k, v, kv_cache, sinks) in enumerate(layers):
                args = (q[queries], k[queries], v[queries], kv_cache, metadata)
                out = impl.forward(*args) if sinks is None else impl.forward(*args, sinks=sinks)
                expected = reference_attention(
                    q[queries],
                    k[context],
                    v[context],
                    step_query_lens,
                    step_seq_lens,
                    spec.sliding_window,
                    spec.softmax_scale,
                    spec.logits_soft_cap,
                    sinks,
                    spec.attention_chunk,
                )
                worst[i] = max(worst[i], (out.float() - expected).abs().max().item())
    return worst
