"""`BlockPool`: the fixed set of KV-cache blocks, their reference counts, the free queue and the
prefix-cache map.

Block 0 is the null block: it is never handed out, so the model runner can pad block tables with 0
and padded reads land in a real block. `num_blocks - 1` blocks are usable.

A freed block keeps its hash and stays findable in the cache until it is handed out again: freeing
never loses cached KV, reuse evicts it. Allocation takes, in this order: freed blocks without cached
content (reusing them loses nothing; most recently freed first), then blocks never handed out (in id
order), then freed cached blocks (least recently freed first, so the cache is LRU).

Start-up is O(1) in the number of blocks, which reaches millions on a large accelerator: blocks never
handed out are a counter, not objects, and a `KVBlock` is made when its block is first handed out (or
read through `blocks`). Every other operation is O(1) per block (OrderedDicts are the linked lists).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import overload


class KVBlock:
    """One block of `block_size` token slots in the KV cache of every layer of the group holding it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None  # its prefix-cache key while it is cached
        self.hash_key: tuple | None = None  # what was hashed: checked on a hit, so collisions miss

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.null_block = KVBlock(0)
        self.null_block.ref_cnt = 1
        # blocks handed out at least once (and the null block), by id; ids from len(_made) on were never
        # handed out and are free, taken in id order
        self._made = [self.null_block]
        self._read_ahead: dict[int, KVBlock] = {}  # blocks never handed out whose object was read
        self._free_plain: OrderedDict[int, KVBlock] = OrderedDict()  # freed uncached: newest taken first
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()  # freed cached: oldest taken first
        self._cached: dict[Hashable, KVBlock] = {}

    @property
    def blocks(self) -> Sequence[KVBlock]:
        """Every block by id, the null block included (reading a block never handed out makes its object)."""
        return _BlockView(self)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not: all can be allocated."""
        return len(self._free_plain) + (self.num_blocks - len(self._made)) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n free blocks in allocation order (see the module docstring), evicting their cached content."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free_plain:
                _, block = self._free_plain.popitem(last=True)
            elif len(self._made) < self.num_blocks:
                block_id = len(self._made)
                block = self._read_ahead.pop(block_id, None) or KVBlock(block_id)
                self._made.append(block)
            else:
                _, block = self._free_cached.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = block.hash_key = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: Hashable, hash_key: tuple) -> KVBlock | None:
        """The cached block made from exactly `hash_key`, or None (also on a hash collision)."""
        block = self._cached.get(block_hash)
        if block is None or block.hash_key != hash_key:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: Hashable, hash_key: tuple) -> bool:
        """Make a full block findable; False when another block already holds this hash."""
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.hash_key = hash_key
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (held ones stay findable); returns how many.
        The forgotten blocks keep their place in the free queue."""
        dropped = 0
        for queue in (self._free_plain, self._free_cached):
            for block in queue.values():
                if block.block_hash is not None:
                    del self._cached[block.block_hash]
                    block.block_hash = block.hash_key = None
                    dropped += 1
        return dropped

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to blocks already handed out once (cached ones), taking free ones out of
        the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._free_plain.pop(block.block_id, None) is None:
                    if self._free_cached.pop(block.block_id, None) is None:
                        raise ValueError(f"block {block.block_id} was never handed out")
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those no longer held join the free queue in this order.

        Pass a request's blocks last first, so its tail (the least shared part) is evicted first.
        A block with no cached content is taken before any other: reusing it loses nothing."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue = self._free_plain if block.block_hash is None else self._free_cached
                queue[block.block_id] = block

    def _block(self, block_id: int) -> KVBlock:
        """The block's object; one never handed out is made on this first read."""
        if block_id < len(self._made):
            return self._made[block_id]
        block = self._read_ahead.get(block_id)
        if block is None:
            block = self._read_ahead[block_id] = KVBlock(block_id)
        return block


class _BlockView(Sequence[KVBlock]):
    """`BlockPool.blocks`: the blocks by id without making every object up front."""

    def __init__(self, pool: BlockPool):
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    @overload
    def __getitem__(self, index: int) -> KVBlock: ...

    @overload
    def __getitem__(self, index: slice) -> list[KVBlock]: ...

    def __getitem__(self, index: int | slice) -> KVBlock | list[KVBlock]:
        if isinstance(index, slice):
            return [self._pool._block(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range (num_blocks {len(self)})")
        return self._pool._block(index % len(self))

    def __iter__(self) -> Iterator[KVBlock]:
        return (self._pool._block(i) for i in range(len(self)))
