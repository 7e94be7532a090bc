"""What the built-in backends share: the per-step metadata saying where the new K/V go, and the store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagellm.core.attention import AttentionBackend, AttentionBatch
from pagellm.core.int8_rows import dequantize_int8_rows as dequantize_int8_rows  # for the backends
from pagellm.core.int8_rows import quantize_int8_rows


@dataclass
class PagedMetadata:
    """A step's batch and where its new k/v go; subclasses add what their `forward` plans once per step."""

    batch: AttentionBatch
    store_slots: torch.Tensor  # where the new k/v go
    store_tokens: torch.Tensor | None  # which tokens have a slot, when some have none; None: all


class PagedBackend(AttentionBackend):
    """A backend whose step metadata is a `PagedMetadata`: it sets `metadata_type` and calls `store_kv`."""

    metadata_type: ClassVar[type[PagedMetadata]] = PagedMetadata

    @classmethod
    def build_metadata(cls, batch: AttentionBatch) -> PagedMetadata:
        """Drop the tokens that store nothing here, so `store_kv` writes with one index_copy_ per layer.

        Negative slots mean "do not store" (padding); finding them costs one host sync per step, not per
        layer."""
        skip = batch.slot_mapping < 0
        if not bool(skip.any()):
            return cls.metadata_type(batch, batch.slot_mapping, None)
        tokens = (~skip).nonzero().squeeze(1)
        return cls.metadata_type(batch, batch.slot_mapping[tokens], tokens)


def store_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    metadata: PagedMetadata,
    heads_first: bool = False,
) -> None:
    """Write the step's new k/v into the cache at their slots, in the cache's dtype (int8: rows with
    their scale, `pagellm.core.int8_rows`).

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_size], the default `kv_cache_shape`, or
    with `heads_first` [2, num_kv_heads, num_blocks, block_size, head_size]; v None: a latent cache (1
    where 2 was), whose one row per token is k."""
    rows = [k] if v is None else [k, v]
    if metadata.store_tokens is not None:
        rows = [t[metadata.store_tokens] for t in rows]
    if kv_cache.dtype == torch.int8:
        rows = [quantize_int8_rows(t) for t in rows]
    elif kv_cache.dtype.itemsize == 1:  # fp8: index_copy_ has no fp8 kernel on CPU, so copy the bytes
        rows = [t.to(kv_cache.dtype).view(torch.uint8) for t in rows]
    if kv_cache.dtype.itemsize == 1:
        kv_cache = kv_cache.view(torch.uint8)
    num_kv, head_size = rows[0].shape[1:]
    for cache, new in zip(kv_cache, rows, strict=True):
        if heads_first:
            cache.view(num_kv, -1, head_size).index_copy_(
                1, metadata.store_slots, new.transpose(0, 1).to(cache.dtype)
            )
        else:
            cache.view(-1, num_kv, head_size).index_copy_(0, metadata.store_slots, new.to(cache.dtype))


EXPLICIT_SCORES = 1 << 24
"""Most float32 scores `explicit_attention` holds at once (64 MiB): longer queries go in slices."""


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in plain float32 ops, for what fused kernels cannot do: soft-capped logits, sink logits.

    q: [..., H, Q, d]; k, v: [..., KV, C, d] with H a multiple of KV (each KV head serves H / KV query heads,
    broadcast, not copied); mask: bool (True = attend) or additive, broadcastable to [..., H, Q, C], or None
    for causal with Q == C; sinks: float32 broadcastable to [..., H, Q] (e.g. [H, 1]). Scores are scaled,
    then capped (cap * tanh(score / cap)), then masked; a sink joins each row's softmax denominator. The
    queries go in slices of at most EXPLICIT_SCORES scores. Returns [..., H, Q, d] in q's dtype."""
    num_kv, num_q, width = k.shape[-3], q.shape[-2], k.shape[-2]
    group = q.shape[-3] // num_kv
    qg = q.unflatten(-3, (num_kv, group)).float()  # [..., KV, G, Q, d]
    kt, vf = k.float().unsqueeze(-3).transpose(-1, -2), v.float().unsqueeze(-3)  # [..., KV, 1, d|C, C|d]
    if mask is None:
        mask = torch.ones(num_q, width, dtype=torch.bool, device=q.device).tril()
    if mask.dim() > 2:  # [..., H or 1, Q, C] -> [..., KV or 1, G or 1, Q, C]
        mask = mask.unflatten(-3, (num_kv, group)) if mask.shape[-3] > 1 else mask.unsqueeze(-3)
    if sinks is not None:
        sinks = sinks.float()
        sinks = sinks.unflatten(-2, (num_kv, group)) if sinks.shape[-2] > 1 else sinks.unsqueeze(-2)
    rows = max(1, EXPLICIT_SCORES // max(1, qg.numel() // (num_q * q.shape[-1]) * width))
    outs = []
    for start in range(0, num_q, rows):
        stop = min(start + rows, num_q)
        scores = qg[..., start:stop, :] @ kt * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        part = mask[..., start:stop, :] if mask.shape[-2] == num_q else mask
        if part.dtype == torch.bool:
            scores = scores.masked_fill(~part, float("-inf"))
        else:
            scores = scores + part.float()
        if sinks is None:
            outs.append(scores.softmax(-1) @ vf)
            continue
        sink = sinks[..., start:stop] if sinks.shape[-1] == num_q else sinks
        top = torch.maximum(scores.amax(-1), sink)  # finite: a sink is one more logit of every row
        weights = torch.exp(scores - top.unsqueeze(-1))
        denominator = weights.sum(-1) + torch.exp(sink - top)
        outs.append((weights @ vf) / denominator.unsqueeze(-1))
    return torch.cat(outs, -2).flatten(-4, -3).to(q.dtype)


def scale_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """A fused kernel's output rescaled for sink logits: it normalised by Z = e^lse, the row's sum of
    exponentials; with the sink the denominator is Z + e^sink, so out * Z / (Z + e^sink) = out *
    sigmoid(lse - sink). out: [..., H, Q, d]; lse: float32 [..., H, Q] (natural log); sinks broadcastable
    to it (e.g. [H, 1])."""
    factor = torch.sigmoid(lse - sinks.float())
    return (out.float() * factor.unsqueeze(-1)).to(out.dtype)


def first_visible(position: int, window: int, chunk: int = 0) -> int:
    """The first key position the query at `position` sees: the window's or the chunk's start (0 without)."""
    if chunk:
        return position // chunk * chunk
    return max(0, position - window + 1) if window else 0
