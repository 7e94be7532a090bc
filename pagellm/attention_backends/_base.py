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
    v: torch.Tensor,
    metadata: PagedMetadata,
    heads_first: bool = False,
) -> None:
    """Write the step's new k/v into the cache at their slots, in the cache's dtype (int8: rows with
    their scale, `pagellm.core.int8_rows`).

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_size], the default `kv_cache_shape`, or
    with `heads_first` [2, num_kv_heads, num_blocks, block_size, head_size]."""
    if metadata.store_tokens is not None:
        k, v = k[metadata.store_tokens], v[metadata.store_tokens]
    if kv_cache.dtype == torch.int8:
        k, v = quantize_int8_rows(k), quantize_int8_rows(v)
    elif kv_cache.dtype.itemsize == 1:  # fp8: index_copy_ has no fp8 kernel on CPU, so copy the bytes
        k, v = k.to(kv_cache.dtype).view(torch.uint8), v.to(kv_cache.dtype).view(torch.uint8)
    if kv_cache.dtype.itemsize == 1:
        kv_cache = kv_cache.view(torch.uint8)
    num_kv, head_size = k.shape[1:]
    for cache, new in ((kv_cache[0], k), (kv_cache[1], v)):
        if heads_first:
            cache.view(num_kv, -1, head_size).index_copy_(
                1, metadata.store_slots, new.transpose(0, 1).to(cache.dtype)
            )
        else:
            cache.view(-1, num_kv, head_size).index_copy_(0, metadata.store_slots, new.to(cache.dtype))
