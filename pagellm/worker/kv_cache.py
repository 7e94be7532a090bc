"""The KV cache's layout and size: one tensor per attention layer, in the backend's `kv_cache_shape` for
this rank's heads, and how many blocks a memory budget holds.

Every place that needs a layer's cache shape (allocation, a block's bytes, the memory profile's one
block, the KV connector's block dimension) asks `kv_cache_shape` here.
"""

from __future__ import annotations

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.core.platform import GiB
from pagellm.distributed import Group
from pagellm.models.base import rank_heads
from pagellm.worker.step import EngineSetup


def rank_spec(setup: EngineSetup, tp: Group) -> AttentionSpec:
    """The attention spec of this tensor-parallel rank's share of the KV heads."""
    return rank_heads(setup.spec, tp)


def kv_cache_shape(setup: EngineSetup, tp: Group, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's cache of `num_blocks` blocks, in the backend's layout."""
    spec = rank_spec(setup, tp)
    return tuple(setup.backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.cache_row_size))


def allocate_kv_caches(
    setup: EngineSetup, tp: Group, layers: list, num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """One cache per attention layer, by layer_idx; an empty tensor for another pipeline stage's (None)."""
    dtype = rank_spec(setup, tp).cache_dtype
    shape = kv_cache_shape(setup, tp, num_blocks, block_size)
    empty = torch.empty(0, dtype=dtype, device=device)
    return [
        torch.zeros(shape, dtype=dtype, device=device) if layer is not None else empty for layer in layers
    ]


def kv_block_bytes(setup: EngineSetup, tp: Group, block_size: int, num_layers: int) -> int:
    """Bytes of one KV block over `num_layers` attention layers of this model."""
    elements = 1
    for size in kv_cache_shape(setup, tp, 1, block_size):
        elements *= size
    return elements * torch.empty((), dtype=rank_spec(setup, tp).cache_dtype).element_size() * num_layers


def blocks_in_budget(setup: EngineSetup, budget: int, block_bytes: int, model_bytes: int) -> int:
    """How many blocks the budget's bytes hold, but no more than max_num_seqs full contexts can use (plus
    the null block): on a large accelerator the memory alone would make millions of blocks, each a start-up
    cost. A ConfigError when fewer than two fit."""
    config = setup.config
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"no memory left for the KV cache ({budget / GiB:.2f} GiB after the model's "
            f"{model_bytes / GiB:.2f} GiB); raise --kv-cache-space or --gpu-memory-utilization"
        )
    per_request = -(-(setup.max_model_len + config.block_size) // config.block_size)
    return int(min(num_blocks, config.max_num_seqs * per_request + 1))
