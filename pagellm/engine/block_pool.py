"""`BlockPool`: the fixed set of KV-cache blocks, their reference counts, the free queue and the
prefix-cache map.

Block 0 is the null block: it is never handed out, so the model runner can pad block tables with 0
and padded reads land in a real block. `num_blocks - 1` blocks are usable.

A freed block keeps its hash and stays findable in the cache until it is handed out again: freeing
never loses cached KV, reuse evicts it. The free queue is LRU: allocation takes from the head, freed
blocks join the tail. Every operation is O(1) per block (an OrderedDict is the doubly linked list).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "hash_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache
        self.hash_key: tuple | None = None  # what was hashed: checked on a hit, so collisions miss

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not: all can be allocated."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = block.hash_key = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int, hash_key: tuple) -> KVBlock | None:
        """The cached block made from exactly `hash_key`, or None (also on a hash collision)."""
        block = self._cached.get(block_hash)
        if block is None or block.hash_key != hash_key:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, hash_key: tuple) -> bool:
        """Make a full block findable; False when another block already holds this hash."""
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.hash_key = hash_key
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (held ones stay findable); returns how many."""
        dropped = 0
        for block in self._free.values():
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = block.hash_key = None
                dropped += 1
        return dropped

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks, removing free ones from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those no longer held join the free queue in this order.

        Pass a request's blocks last first, so its tail (the least shared part) is evicted first.
        A block with no cached content goes to the head instead: reusing it loses nothing."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
