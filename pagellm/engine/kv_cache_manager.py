"""`KVCacheManager`: which blocks hold each request's KV, and automatic prefix caching.

A full block is identified by a chained hash of (parent block's hash, its token ids), so equal hashes
mean equal prefixes. The pool keeps what was hashed and a hit must match it
exactly, so a hash collision is a miss, never wrong KV. A request's hashes are computed once per block
and kept on the request.

Blocks are cached when their tokens have been computed (`cache_blocks`, called after each step), not
when they are allocated: a block is findable only once its KV is really written, so a request scheduled
in the same step never reads KV that step has not produced, and a failed step leaves no bogus entries.
"""

from __future__ import annotations

from pagellm.engine.block_pool import BlockPool, KVBlock
from pagellm.engine.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block."""
    return hash((parent_hash, token_ids))


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each request already offered to the cache
        self.prefix_cache_queries = 0  # tokens of admitted requests that looked up the cache
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds at once (block 0 is reserved)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Never covers the last known token (its logits must be computed), and finds nothing for requests
        that need every prompt position computed (prompt logprobs, MEAN or CLS pooling)."""
        if not self._uses_prefix_cache(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        blocks = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(request.block_hashes[i], self._block_key(request, i))
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` (from `get_computed_blocks`, only on the request's first allocation after
        admission) are taken as its leading blocks. Returns False, changing nothing, when too few blocks
        are free; cached free blocks count as free."""
        computed_blocks = computed_blocks or []
        held = self._blocks.get(request.request_id)
        num_held = len(held) if held is not None else 0
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = max(0, -(-num_tokens // self.block_size) - num_held - len(computed_blocks))
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_needed)
        if held is None:
            held = self._blocks[request.request_id] = []
            self._block_ids[request.request_id] = []
            self._num_cached[request.request_id] = len(computed_blocks)
            if self._uses_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * self.block_size
        held.extend(computed_blocks)
        held.extend(new_blocks)
        self._block_ids[request.request_id].extend(block.block_id for block in computed_blocks + new_blocks)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's blocks that `num_computed_tokens` fills findable by later requests."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached[request.request_id]
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request, end)
        blocks = self._blocks[request.request_id]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i], self._block_key(request, i))
        self._num_cached[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached ones stay findable until reused. No-op if it holds none."""
        blocks = self._blocks.pop(request.request_id, None)
        if blocks is None:
            return
        del self._block_ids[request.request_id]
        del self._num_cached[request.request_id]
        self.pool.free_blocks(reversed(blocks))

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._blocks

    def release_loaded(self, request: Request, num_hit: int, num_loaded_tokens: int) -> None:
        """A KV connector's load into the request's blocks ended: make the first `num_loaded_tokens` findable,
        free every block, and take back the lookup its admission counted (`num_hit` tokens found), since it is
        admitted again and then finds the loaded blocks as hits."""
        self.cache_blocks(request, num_loaded_tokens)
        self.prefix_cache_queries -= request.num_tokens
        self.prefix_cache_hits -= num_hit
        self.free(request)

    def uses_prefix_cache(self, request: Request) -> bool:
        return self._uses_prefix_cache(request)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in order; a live list that grows as blocks are added, do not modify."""
        return self._block_ids[request_id]

    def _uses_prefix_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and not request.needs_every_prompt_position

    def _block_key(self, request: Request, i: int) -> tuple:
        parent = request.block_hashes[i - 1] if i else request.cache_salt
        tokens = tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
        return parent, tokens

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block_tokens(*self._block_key(request, i)))
