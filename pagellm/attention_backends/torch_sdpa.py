"""TORCH_SDPA: paged attention with torch's `scaled_dot_product_attention`, on any device.

The reference backend, and the fallback where nothing faster fits. K/V are gathered from the paged cache
through the block tables; all single-token (decode) requests share one padded SDPA call with their query
heads grouped by KV head, and every other request (a prefill chunk) gets one SDPA call against its whole
context. Gather indices and masks depend only on the step and the sliding window (or attention chunk), so
they are built once per step and window, and shared by all layers. A chunked-local-attention layer
(`attention_chunk`) gathers only its queries' chunks and masks keys of earlier chunks. A `bidirectional_spans` layer's prefill masks also let each of the
step's spans (an image's tokens) see itself both ways. SDPA can neither cap logits nor take sink logits, so layers with
either run the same plan through `explicit_attention`: plain float32 ops, queries in slices. A latent (MLA)
layer's cache holds one row per token; its V is a view of the gathered K rows' first v_size elements, and
SDPA takes V narrower than K (torch's math kernel: the fused CPU kernel wants one head size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.attention_backends._base import (
    PagedBackend,
    PagedMetadata,
    explicit_attention,
    first_visible,
    store_kv,
)
from pagellm.core.attention import AttentionBackend, AttentionBatch
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"


@dataclass
class _Prefill:
    tokens: slice  # the request's query tokens in the flat batch
    slots: torch.Tensor | None  # cache slots of the context it reads; None: only its own new k/v
    mask: torch.Tensor | None  # [Q, C], True = attend; None: plain causal over its own k/v


@dataclass
class _Decode:
    tokens: slice | torch.Tensor  # the single-token requests' tokens in the flat batch
    slots: torch.Tensor  # [B * W] cache slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, W], False on padding


@dataclass
class _Plan:
    prefills: list[_Prefill]
    decode: _Decode | None


@dataclass
class TorchSDPAMetadata(PagedMetadata):
    plans: dict[tuple[int | None, int, bool, int | None], _Plan] = field(default_factory=dict)

    def plan(
        self,
        sliding_window: int | None,
        block_size: int,
        bidirectional: bool = False,
        chunk: int | None = None,
    ) -> _Plan:
        """Gather indices and masks, built by the first layer that asks and reused by the others;
        `bidirectional`: with the batch's bidirectional spans; `chunk`: the layer's attention chunk."""
        key = (sliding_window, block_size, bidirectional, chunk)
        if key not in self.plans:
            spans = self.batch.bidirectional if bidirectional else ()
            self.plans[key] = _make_plan(self.batch, sliding_window, block_size, spans, chunk or 0)
        return self.plans[key]


class TorchSDPABackend(PagedBackend):
    name = "TORCH_SDPA"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supports_latent_kv = True
    supports_bidirectional_spans = True
    supports_attention_chunk = True
    supports_index_topk = True  # its slot-major rows, which sparse attention gathers (sparse_attention.py)
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    metadata_type = TorchSDPAMetadata

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchSDPAMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = self.spec
        store_kv(kv_cache, k, None if s.latent_kv else v, metadata)
        k_cache = kv_cache[0].view(-1, s.num_kv_heads, s.head_size)  # [num_blocks * block_size, kv, d]
        v_cache = None if s.latent_kv else kv_cache[1].view(-1, s.num_kv_heads, s.head_size)

        def gather(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """K and V rows at `slots`, in q's dtype; a latent layer's V is its K rows' prefix."""
            rows = k_cache.index_select(0, slots).to(q.dtype)
            if v_cache is None:
                return rows, rows[..., : s.v_size]
            return rows, v_cache.index_select(0, slots).to(q.dtype)

        plan = metadata.plan(s.sliding_window, kv_cache.shape[2], s.bidirectional_spans, s.attention_chunk)
        out = q.new_zeros(*q.shape[:2], s.v_size)
        for p in plan.prefills:
            if p.slots is None:
                ctx_k, ctx_v = k[p.tokens], v[p.tokens]
            else:
                ctx_k, ctx_v = gather(p.slots)
            o = self._attend(
                q[p.tokens].transpose(0, 1),
                ctx_k.transpose(0, 1),
                ctx_v.transpose(0, 1),
                p.mask,
                None if sinks is None else sinks.view(-1, 1),  # [H, 1]: per head, every query
            )
            out[p.tokens] = o.transpose(0, 1)
        if plan.decode is not None:
            d = plan.decode
            batch_size, width = d.mask.shape[0], d.mask.shape[-1]
            group = s.num_heads // s.num_kv_heads
            dq = q[d.tokens].reshape(batch_size, s.num_kv_heads, group, s.head_size)
            dk, dv = gather(d.slots)
            o = self._attend(
                dq,
                dk.unflatten(0, (batch_size, width)).transpose(1, 2),
                dv.unflatten(0, (batch_size, width)).transpose(1, 2),
                d.mask,
                None if sinks is None else sinks.view(s.num_kv_heads, group),  # the group is the query axis
            )
            out[d.tokens] = o.reshape(batch_size, s.num_heads, s.v_size)
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """q: [..., H, Q, d], k: [..., KV, C, d], v: [..., KV, C, dv]; mask None means causal with Q == C;
        sinks broadcastable to [..., H, Q], or None."""
        cap, scale = self.spec.logits_soft_cap, self.spec.softmax_scale
        if cap is not None or self.spec.has_sinks:
            return explicit_attention(q, k, v, mask, scale, cap, sinks)
        num_kv, group = k.shape[-3], q.shape[-3] // k.shape[-3]
        if group == 1:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
            )

        # GQA as [KV, group] heads with K/V broadcast over each KV head's query heads: torch keeps its fused
        # kernels (enable_gqa with a bool mask falls back to the math path on CPU, and CUDA's fused kernels
        # refuse it)
        def expanded(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(-3).expand(*t.shape[:-3], num_kv, group, *t.shape[-2:])

        o = F.scaled_dot_product_attention(
            q.unflatten(-3, (num_kv, group)),
            expanded(k),
            expanded(v),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        return o.flatten(-4, -3)


def _make_plan(
    batch: AttentionBatch,
    sliding_window: int | None,
    block_size: int,
    spans: tuple[tuple[int, int, int], ...] = (),
    chunk: int = 0,
) -> _Plan:
    """Split the step into prefill chunks and decodes; build their cache gather indices and masks.

    Query token j of a request with L tokens of context and Q query tokens sits at position L - Q + j and
    sees positions <= that, and the rest of a span of `spans` (request index, first, end position) it lies
    in; and only those > that - sliding_window when set, and only those of its own `chunk` when set.
    Context older than every query's window or chunk is not gathered at all. A one-token query needs no
    span: it is the last of any span it lies in."""
    own: dict[int, list[tuple[int, int]]] = {}
    for i, first, end in spans:
        own.setdefault(i, []).append((first, end))
    device = batch.block_tables.device
    starts = batch.query_start_loc_cpu.tolist()
    seq_lens = batch.seq_lens_cpu.tolist()
    window = sliding_window or 0
    prefills, decode_reqs = [], []
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if query_len == 0:
            continue
        if query_len == 1:
            decode_reqs.append(i)
            continue
        tokens = slice(starts[i], starts[i + 1])
        if query_len == seq_len:  # nothing cached: attend over its own new k/v
            mask = None
            if (window and window < query_len) or (chunk and chunk < query_len) or i in own:
                pos = torch.arange(query_len, device=device)
                mask = _visible(pos, pos, window, own.get(i, ()), chunk)
            prefills.append(_Prefill(tokens, None, mask))
            continue
        first = first_visible(seq_len - query_len, window, chunk)
        pos = torch.arange(first, seq_len, device=device)
        slots = batch.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        prefills.append(_Prefill(tokens, slots, _visible(query_pos, pos, window, own.get(i, ()), chunk)))
    return _Plan(prefills, _make_decode(batch, decode_reqs, starts, seq_lens, window, block_size, chunk))


def _visible(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    window: int,
    spans: Sequence[tuple[int, int]] = (),
    chunk: int = 0,
) -> torch.Tensor:
    """[Q, C], True where the query sees the key: causal or both in one of `spans` ([first, end)
    positions), then within the window when set (transformers' Gemma 3: AND(window, OR(causal, span))),
    and within the query's chunk when set."""
    diff = query_pos[:, None] - key_pos[None, :]
    mask = diff >= 0
    for first, end in spans:
        mask |= ((query_pos >= first) & (query_pos < end))[:, None] & ((key_pos >= first) & (key_pos < end))
    if chunk:
        mask &= (query_pos // chunk)[:, None] == (key_pos // chunk)[None, :]
    return mask & (diff < window) if window else mask


def _make_decode(
    batch: AttentionBatch,
    reqs: list[int],
    starts: list[int],
    seq_lens: list[int],
    window: int,
    block_size: int,
    chunk: int = 0,
) -> _Decode | None:
    if not reqs:
        return None
    device = batch.block_tables.device
    lens = [seq_lens[i] for i in reqs]
    firsts = [first_visible(n - 1, window, chunk) for n in lens]
    width = max(n - f for n, f in zip(lens, firsts, strict=True))
    pos = torch.tensor(firsts, device=device)[:, None] + torch.arange(width, device=device)
    valid = pos < torch.tensor(lens, device=device)[:, None]
    rows = torch.tensor(reqs, device=device)
    columns = (pos // block_size).clamp(max=batch.block_tables.shape[1] - 1)
    blocks = batch.block_tables[rows[:, None], columns].long()
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    token_ids = [starts[i] for i in reqs]
    contiguous = token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids)))
    tokens = slice(token_ids[0], token_ids[-1] + 1) if contiguous else torch.tensor(token_ids, device=device)
    return _Decode(tokens, slots.view(-1), valid[:, None, None, :])


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [TorchSDPABackend]
