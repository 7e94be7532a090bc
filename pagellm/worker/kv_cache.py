"""The KV cache's layout and size: KV tensors in the backend's `layer_cache_shape` for this rank's heads (K
and V rows, or one latent row per token for an MLA model), one per attention layer with one KV cache
group, else one per layer of a group, shared by the same layer of every group (`core/kv_cache_spec.py`),
and how many blocks a memory budget holds.

Every place that needs a layer's cache shape (allocation, a block's bytes, the memory profile's one
block, the KV connector's block dimension) asks `kv_cache_shape` here.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from typing import Any

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.core.kv_cache_spec import KVCacheGroup, KVCacheLayout, KVCacheSpec
from pagellm.core.platform import GiB
from pagellm.distributed import Group
from pagellm.models.base import rank_heads
from pagellm.worker.step import EngineSetup


def rank_spec(setup: EngineSetup, tp: Group) -> AttentionSpec:
    """The attention spec of this tensor-parallel rank's share of the KV heads."""
    return rank_heads(setup.spec, tp)


def kv_cache_shape(
    setup: EngineSetup, tp: Group, num_blocks: int, block_size: int, layer: Any = None
) -> tuple[int, ...]:
    """One layer's cache of `num_blocks` blocks, in the backend's layout (`layer`: an attention layer
    whose KV heads or head size may differ from the engine's spec, Gemma 4's full layers)."""
    return tuple(setup.backend.layer_cache_shape(layer_spec(setup, tp, layer), num_blocks, block_size))


def layer_spec(setup: EngineSetup, tp: Group, layer: Any = None) -> AttentionSpec:
    """The spec a layer's cache is shaped by: this rank's engine spec, with the layer's own KV heads and
    head size where they differ from it."""
    spec = rank_spec(setup, tp)
    own = getattr(layer, "spec", None)
    if own is None or (own.num_kv_heads, own.head_size) == (spec.num_kv_heads, spec.head_size):
        return spec
    # its own V width too: a latent cache narrower than the engine's V (DeepSeek-V3.2's indexer keys)
    return dataclasses.replace(
        spec, num_kv_heads=own.num_kv_heads, head_size=own.head_size, v_head_size=own.v_head_size
    )


def kv_layout(setup: EngineSetup, num_layers: int) -> KVCacheLayout:
    """The model's KV cache groups (`EngineSetup.kv_layout`); one group of every layer where none was set."""
    if setup.kv_layout is not None:
        return setup.kv_layout
    return KVCacheLayout((KVCacheGroup(KVCacheSpec.of(setup.spec), tuple(range(num_layers))),), num_layers)


def allocate_kv_caches(
    setup: EngineSetup,
    tp: Group,
    layers: list,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    layout: KVCacheLayout | None = None,
) -> list[torch.Tensor]:
    """The cache of every attention layer, by layer_idx; an empty tensor for another pipeline stage's
    (None). Without `layout` (a draft model's) each layer has a tensor of its own; with one, the layers at
    the same place of their groups share one (`KVCacheLayout.tensor_of`)."""
    dtype = rank_spec(setup, tp).cache_dtype
    empty = torch.empty(0, dtype=dtype, device=device)
    tensors: dict[int, torch.Tensor] = {}
    caches = []
    for i, layer in enumerate(layers):
        if layer is None:
            caches.append(empty)
            continue
        j = layout.tensor_of(i) if layout is not None else i
        if j not in tensors:
            tensors[j] = zeroed(kv_cache_shape(setup, tp, num_blocks, block_size, layer), dtype, device)
        caches.append(tensors[j])
    return caches


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU, an anonymous memory mapping: the kernel hands out zeroed pages on first
    touch, so a cache of many GiB costs nothing at start-up and memory as it fills (`torch.zeros` wrote every
    page first: 4.5 s of a 4 GiB cache's start on the AVX2 EPYC). The zeros are the same either way; the
    caches start zeroed because a backend may read a block's unwritten slots under a mask, and garbage (a
    NaN) times a zero weight is still NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the mapping alive (frombuffer holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def num_kv_tensors(layers: list, layout: KVCacheLayout | None) -> int:
    """KV tensors `allocate_kv_caches` makes for these layers (None: another stage's)."""
    local = [i for i, layer in enumerate(layers) if layer is not None]
    return len({layout.tensor_of(i) for i in local}) if layout is not None else len(local)


def layers_block_bytes(
    setup: EngineSetup, tp: Group, block_size: int, layers: list, layout: KVCacheLayout | None
) -> int:
    """Bytes of one KV block over the KV tensors `allocate_kv_caches` makes for these layers, each of its
    own shape (a layer reading another's cache has none)."""
    itemsize = torch.empty((), dtype=rank_spec(setup, tp).cache_dtype).element_size()
    sizes: dict[int, int] = {}
    for i, layer in enumerate(layers):
        if layer is not None:
            shape = kv_cache_shape(setup, tp, 1, block_size, layer)
            sizes[layout.tensor_of(i) if layout is not None else i] = math.prod(shape) * itemsize
    return sum(sizes.values())


def kv_block_bytes(setup: EngineSetup, tp: Group, block_size: int, num_layers: int) -> int:
    """Bytes of one KV block over `num_layers` attention layers (KV tensors) of this model."""
    elements = 1
    for size in kv_cache_shape(setup, tp, 1, block_size):
        elements *= size
    return elements * torch.empty((), dtype=rank_spec(setup, tp).cache_dtype).element_size() * num_layers


def blocks_in_budget(
    setup: EngineSetup, budget: int, block_bytes: int, model_bytes: int, per_request: int | None = None
) -> int:
    """How many blocks the budget's bytes hold, but no more than max_num_seqs full contexts can use (plus
    the null block): on a large accelerator the memory alone would make millions of blocks, each a start-up
    cost. `per_request`: the blocks one context of max_model_len tokens holds over every KV cache group
    (default: one group, plus a block of slack). A ConfigError when fewer than two fit."""
    config = setup.config
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"no memory left for the KV cache ({budget / GiB:.2f} GiB after the model's "
            f"{model_bytes / GiB:.2f} GiB); raise --kv-cache-space or --gpu-memory-utilization"
        )
    if per_request is None:
        per_request = -(-(setup.max_model_len + config.block_size) // config.block_size)
    return int(min(num_blocks, config.max_num_seqs * per_request + 1))
