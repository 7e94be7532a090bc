"""KV cache specs and groups: what each attention layer keeps per token, and which layers share a block
table (vLLM v1's `KVCacheSpec` and KV cache groups, docs/architecture.md "Scheduler").

A layer's `KVCacheSpec` is what its KV cache needs of the engine: the block size, the KV heads, the rows
per token and head (K and V, or MLA's one latent row), the row size and the cache dtype (which fix a
block's bytes, its "page"), and the sliding window, which says
which blocks the layer can still read. Layers with equal specs form a group; soft-caps, scales and other
compute-only fields do not split groups. The KV cache manager keeps one block table per group per
request, every group indexing tokens alike (token t lies in block t // block_size of each table), so the
runner builds each group's slot mapping and attention metadata the same way from its own block ids.

One pool, blocks of one cost (vLLM's hybrid allocator): every group holds the same number of layers,
`layers_per_block` (the smallest count of layers sharing a spec, or the largest when the counts are
within a quarter of each other), a spec with more layers being split into several groups (the last
padded), and layer j of every group uses KV tensor j. A block id therefore costs the same bytes whichever
group holds it, so one free pool serves them all: a block a sliding-window group lets go is at once room
for any group, and short contexts, which need as many blocks in every group, use the whole cache. (Pools
per group would have to split the memory in advance on a guess at the context lengths to come.)

The group key is the whole spec, so layers with other head sizes or KV heads (Gemma 4's full layers)
form groups of their own, and their groups use KV tensors of their own shape (`KVCacheSpec.shape`): a
block id has room in every tensor, so while one kind holds it the other kind's room for it is idle (simple
and right for every backend's layout; vLLM instead unifies the pages by block size). A latent layer (MLA,
`AttentionSpec.latent_kv`) keeps one row per token, so its page is half that of a layer with K and V rows
of the same width, and it never shares a group with one (a model with both is refused).

A chunked-local-attention layer (`AttentionSpec.attention_chunk` C, Llama 4) reads only its query's chunk,
so its group frees blocks like a sliding-window group: `KVCacheLayout.windows` gives it a `LocalChunk(C)`,
an int equal in value to C (a query reads at most C - 1 tokens back, so every bound made for a window of C
holds) that the KV cache manager recognises to free whole chunks once every query is past them.

A layer whose spec names a `kv_source` (Gemma 4's shared-KV layers) reads that earlier layer's cache: it
joins no group, has no tensor and counts in no block, and the runner gives it its source's group (block
table, slot mapping, metadata) and tensor (`KVCacheLayout.readers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.core.dtypes import dtype_name
from pagellm.core.errors import ConfigError


class LocalChunk(int):
    """A chunked-local-attention group's entry in the KV cache windows: its chunk size C. As an int it is
    C, a window no query reaches past (bounds on blocks held stay right); the KV cache manager frees and
    matches its blocks by chunk. Not equal to a plain window of C: the two are different kinds of group."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalChunk) and int(self) == int(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("chunk", int(self)))

    def __repr__(self) -> str:
        return f"LocalChunk({int(self)})"


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps in the KV cache: equal specs share a group (the group key)."""

    block_size: int
    num_kv_heads: int
    row_size: int  # elements of one cached K or V row (AttentionSpec.cache_row_size)
    dtype: torch.dtype  # the cache's
    sliding_window: int | None = None  # None: full attention, every block stays readable
    rows: int = 2  # rows per token and KV head: K and V, or 1 for a latent layer (AttentionSpec.kv_rows)
    attention_chunk: int | None = None  # chunked local attention: blocks of finished chunks are unreadable

    @classmethod
    def of(cls, spec: AttentionSpec) -> KVCacheSpec:
        return cls(
            spec.block_size,
            spec.num_kv_heads,
            spec.cache_row_size,
            spec.cache_dtype,
            spec.sliding_window,
            spec.kv_rows,
            spec.attention_chunk,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer: its rows (K and V, or the latent one) of block_size tokens."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.rows * self.block_size * self.num_kv_heads * self.row_size * itemsize

    @property
    def kind(self) -> str:
        if self.attention_chunk is not None:
            return f"chunked local attention {self.attention_chunk}"
        return "full" if self.sliding_window is None else f"sliding window {self.sliding_window}"

    @property
    def window(self) -> int | None:
        """What the KV cache manager honours: the sliding window, a `LocalChunk`, or None (keep every block)."""
        return LocalChunk(self.attention_chunk) if self.attention_chunk is not None else self.sliding_window

    @property
    def shape(self) -> tuple:
        """What a KV tensor's shape depends on: groups that differ only in their window share tensors."""
        return (self.block_size, self.num_kv_heads, self.row_size, self.dtype, self.rows)


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layers: tuple[int, ...]  # layer_idx of its layers, ascending; its j-th layer uses KV tensor j


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's KV cache groups: full-attention groups first (a draft model and the KV connectors read
    group 0's table), then sliding-window groups by window."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # layers of every group; the KV tensors of each cache shape
    readers: tuple[tuple[int, int], ...] = ()  # (layer, the layer whose KV cache it reads): in no group
    _tensor_of: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        shapes: list[tuple] = []  # groups of another cache shape (head size, KV heads) use other tensors
        for g, group in enumerate(self.groups):
            if group.spec.shape not in shapes:
                shapes.append(group.spec.shape)
            first = shapes.index(group.spec.shape) * self.layers_per_block
            for j, layer in enumerate(group.layers):
                self._tensor_of[layer] = (g, first + j)
        for layer, source in self.readers:
            self._tensor_of[layer] = self._tensor_of[source]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (a `LocalChunk` for chunked local attention); None for full attention."""
        return tuple(group.spec.window for group in self.groups)

    def group_of(self, layer_idx: int) -> int:
        return self._tensor_of[layer_idx][0]

    def tensor_of(self, layer_idx: int) -> int:
        """The KV tensor layer `layer_idx` keeps its blocks in (shared with the same place of every other
        group of its cache shape; a reader's is its source's)."""
        return self._tensor_of[layer_idx][1]

    @property
    def num_tensors(self) -> int:
        return len({tensor for _, tensor in self._tensor_of.values()})

    def describe(self) -> str:
        """One line: "KV cache: 6 groups of 1 layer: full (1 layer), sliding window 1024 (5 layers)"."""
        kinds: dict[str, int] = {}
        for group in self.groups:
            kinds[group.spec.kind] = kinds.get(group.spec.kind, 0) + len(group.layers)
        n, per = self.num_groups, self.layers_per_block
        parts = ", ".join(f"{kind} ({count} layer{'s' * (count != 1)})" for kind, count in kinds.items())
        line = f"KV cache: {n} group{'s' * (n != 1)} of {per} layer{'s' * (per != 1)}: {parts}"
        if self.readers:
            r = len(self.readers)
            line += f"; {r} layer{'s' * (r != 1)} reading another layer's cache, keeping none"
        return line


def group_layers(specs: Sequence[AttentionSpec]) -> KVCacheLayout:
    """Group the model's attention layers (`specs[i]`: layer i's) by KV cache spec, each spec's layers
    split into groups of `layers_per_block` (vLLM's rule: layers[i::n] to group i, so that a pipeline
    stage's layers spread over the groups). A layer whose spec names a `kv_source` joins no group: it reads
    that layer's blocks (a ConfigError unless that is an earlier layer of the same KV cache spec with a
    cache of its own)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    readers = []
    for i, spec in enumerate(specs):
        if spec.kv_source is None:
            by_spec.setdefault(KVCacheSpec.of(spec), []).append(i)
            continue
        source = spec.kv_source
        if not 0 <= source < i or specs[source].kv_source is not None:
            raise ConfigError(
                f"attention layer {i} reads layer {source}'s KV cache: not an earlier layer with one"
            )
        if KVCacheSpec.of(specs[source]) != KVCacheSpec.of(spec):
            raise ConfigError(
                f"attention layer {i} reads layer {source}'s KV cache, whose spec differs from its own"
            )
        readers.append((i, source))
    if not by_spec:
        raise ConfigError("the model has no attention layers: there is no KV cache to lay out")
    counts = [len(layers) for layers in by_spec.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:  # few padding layers: one group per spec
        size = max(counts)
    if len({spec.rows for spec in by_spec}) > 1:
        shapes = "; ".join(
            f"{spec.kind}: {spec.rows} x {spec.num_kv_heads} KV heads x {spec.row_size} {dtype_name(spec.dtype)}"
            for spec in by_spec
        )
        raise ConfigError(
            f"the model's attention layers keep KV blocks of different sizes ({shapes}): latent (MLA) "
            "layers beside K and V rows are not supported"
        )
    groups = []
    order = sorted(
        by_spec, key=lambda s: (s.window is not None, int(s.window or 0), s.attention_chunk is not None)
    )
    for spec in order:
        layers = by_spec[spec]
        n = math.ceil(len(layers) / size)
        groups += [KVCacheGroup(spec, tuple(layers[i::n])) for i in range(n)]
    return KVCacheLayout(tuple(groups), size, tuple(readers))


def window_blocks(window: int, block_size: int, step_tokens: int = 1) -> int:
    """The most blocks a sliding-window group holds for one request in a step of `step_tokens` tokens: what
    its first query reads before it (window - 1 tokens) and the step's own tokens."""
    return -(-(window - 1 + step_tokens - 1) // block_size) + 1


def blocks_per_request(
    windows: Sequence[int | None], block_size: int, num_tokens: int, step_tokens: int = 1
) -> int:
    """Blocks, over groups of these windows (None: full attention), that one request of `num_tokens` tokens
    holds at most when its steps run up to `step_tokens` tokens."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, window_blocks(w, block_size, step_tokens)) for w in windows)
