"""Bidirectional spans (Gemma 3's image tokens) in the backends that claim them, against a dense float32
reference of transformers' rule: a query sees a key when it is not later or both lie in one span, and, with a
window, only when q - k < window. One request runs whole with two spans, one runs the rest of a span whose
first tokens are cached (a prefix-cache hit ending inside an image), one decodes; backends without the
feature are skipped by the selector with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm.attention_backends.cpu_attn import CpuAttnBackend
from pagellm.attention_backends.flex_attention import FlexAttentionBackend
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionSpec
from pagellm.core.synthetic import make_paged_batch
from pagellm.platforms.cpu import CpuPlatform

SEQ_LENS, QUERY_LENS = [40, 30, 21], [40, 12, 1]
SPANS = ((0, 5, 17), (0, 20, 36), (1, 14, 26))  # request 1's first 4 span tokens are cached


def reference(q, k, v, window: int | None, scale: float) -> torch.Tensor:
    outs, q_start, kv_start = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for i, (seq_len, query_len) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        query_pos, key_pos = torch.arange(seq_len - query_len, seq_len), torch.arange(seq_len)
        diff = query_pos[:, None] - key_pos[None, :]
        visible = diff >= 0
        for j, first, end in SPANS:
            if j == i:
                in_q, in_k = (query_pos >= first) & (query_pos < end), (key_pos >= first) & (key_pos < end)
                visible |= in_q[:, None] & in_k[None, :]
        if window is not None:
            visible &= diff < window
        qi = q[q_start : q_start + query_len].transpose(0, 1)
        ki = k[kv_start : kv_start + seq_len].repeat_interleave(group, 1).transpose(0, 1)
        vi = v[kv_start : kv_start + seq_len].repeat_interleave(group, 1).transpose(0, 1)
        scores = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        q_start, kv_start = q_start + query_len, kv_start + seq_len
    return torch.cat(outs)


@pytest.mark.parametrize("backend", [TorchSDPABackend, FlexAttentionBackend])
@pytest.mark.parametrize("window", [None, 8])
def test_spans_attend_both_ways(backend, window):
    spec = AttentionSpec(
        4, 2, 16, torch.float32, block_size=8, sliding_window=window, bidirectional_spans=True
    )
    gen = torch.Generator().manual_seed(0)
    total = sum(SEQ_LENS)
    q, k, v = (torch.randn(total, h, 16, generator=gen) for h in (4, 2, 2))
    starts = [sum(SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]
    queries = torch.cat(
        [torch.arange(s + n - m, s + n) for s, n, m in zip(starts, SEQ_LENS, QUERY_LENS, strict=True)]
    )
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, 8, generator=gen)
    cache = torch.zeros(backend.layer_cache_shape(spec, batch.block_tables.max().item() + 1, 8))
    impl = backend(spec)
    cached = [
        n - m for n, m in zip(SEQ_LENS, QUERY_LENS, strict=True)
    ]  # written first, as an earlier step would
    rows = [i for i, n in enumerate(cached) if n]
    first = make_paged_batch(
        [cached[i] for i in rows], [cached[i] for i in rows], 8, block_tables=batch.block_tables[rows]
    )
    context = torch.cat([torch.arange(starts[i], starts[i] + cached[i]) for i in rows])
    impl.forward(q[context], k[context], v[context], cache, backend.build_metadata(first))
    step = dataclasses.replace(batch, bidirectional=SPANS)
    out = impl.forward(q[queries], k[queries], v[queries], cache, backend.build_metadata(step))
    expected = reference(q[queries], k, v, window, spec.softmax_scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the spans change the answer: the same step without them is causal
    causal = impl.forward(q[queries], k[queries], v[queries], cache, backend.build_metadata(batch))
    assert not torch.allclose(causal, expected, atol=1e-3)


def test_a_backend_without_spans_is_refused_with_the_reason():
    spec = AttentionSpec(4, 2, 16, torch.float32, bidirectional_spans=True)
    assert "no bidirectional spans" in " ".join(CpuAttnBackend.unsupported_reasons(spec, CpuPlatform))
    assert not TorchSDPABackend.unsupported_reasons(spec, CpuPlatform)
