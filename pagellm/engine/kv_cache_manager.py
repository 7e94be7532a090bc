"""`KVCacheManager`: which blocks hold each request's KV, in each KV cache group, and automatic prefix
caching.

Groups (`core/kv_cache_spec.py`): layers with equal KV specs share a block table, so a request holds one
table per group, all of one length (token t lies in block t // block_size of each), their ids from one
shared pool. A full-attention group keeps every block. A sliding-window group (window W) keeps only the
blocks a query can still read (vLLM's `SlidingWindowManager.remove_skipped_blocks`): the next step's
first query, at position c = num_computed_tokens, looks back to c - W + 1, so the blocks wholly before
that are freed when the request next allocates, and the null block (id 0) takes their place in the
group's table. A chunked-local-attention group (chunk C, a `LocalChunk` among the windows) keeps only the
blocks of the chunk that position c lies in, from c // C * C on: a query never reads an earlier chunk.
A prefill chunk keeps all its own blocks until it has run (its first query reads W - 1
tokens before the chunk, its last query its own chunk); drafts to verify and a draft model's lookahead
slots come after c; a preempted request frees everything and recomputes (or finds its prefix cached). A
group whose whole table another reader needs (a draft model reads group 0's, a KV connector every
group's) is given window None here and keeps every block.

Prefix caching: a full block is identified by a chained hash of (parent block's hash, its token ids), so
equal hashes mean equal prefixes; group g > 0 caches its block under (g, hash). The pool keeps what was
hashed and a hit must match it exactly, so a hash collision is a miss, never wrong KV. A request's hashes
are computed once per block and kept on the request. A hit of n blocks needs blocks 0..n-1 of every
full-attention group, but of a sliding-window group only those holding the W - 1 tokens before position
n * block_size, found scanning from the right (vLLM's `find_longest_cache_hit`), and of a chunked group only
those from the chunk start of position n * block_size on (none when that position starts a chunk); the
hit is the longest n
that every group agrees on (each kind of group is asked again with the shorter n until none shortens it).

Blocks are cached when their tokens have been computed (`cache_blocks`, called after each step), not
when they are allocated: a block is findable only once its KV is really written, so a request scheduled
in the same step never reads KV that step has not produced, and a failed step leaves no bogus entries.
A window group's freed blocks stay cached until reused, so later requests still find them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagellm.core.kv_cache_spec import LocalChunk, blocks_per_request, window_blocks
from pagellm.engine.block_pool import BlockPool, KVBlock
from pagellm.engine.request import Request
from pagellm.multimodal.inputs import block_image_keys


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], *extra: Hashable) -> int:
    """Chained hash of one full block; `extra`: what else its KV depends on (the images it overlaps)."""
    return hash((parent_hash, token_ids, *extra))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ComputedBlocks(list):
    """A prefix-cache hit (`get_computed_blocks`): group 0's blocks (the list itself) and every group's
    (`groups`), all as long as the hit, with the null block where a sliding-window group needs none."""

    def __init__(self, groups: Sequence[list[KVBlock]]):
        super().__init__(groups[0])
        self.groups = tuple(groups)


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ):
        """`windows`: each KV cache group's sliding window as honoured here (None: keep every block)."""
        if not windows:
            raise ValueError("a KV cache has at least one group")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.pool = BlockPool(num_blocks)
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        kinds: dict[int | None, list[int]] = {}
        for g, w in enumerate(self.windows):
            kinds.setdefault(w, []).append(g)
        # groups by window, full attention first: a prefix-cache hit is checked kind by kind
        self._kinds = sorted(kinds.items(), key=lambda kind: (kind[0] is not None, int(kind[0] or 0)))
        self._blocks: dict[str, tuple[list[KVBlock], ...]] = {}  # per group, null block where freed
        self._block_ids: dict[str, tuple[list[int], ...]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each request already offered to the cache
        self._num_skipped: dict[str, list[int]] = {}  # per group: leading blocks freed behind the window
        self.prefix_cache_queries = 0  # tokens of admitted requests that looked up the cache
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def capacity_tokens(self) -> int:
        """Tokens of context the cache holds at once (block 0 is reserved): every usable block's tokens with
        one full-attention group (or none); with sliding-window groups beside full ones, one request's
        longest context, its windows' blocks taken first."""
        usable = self.num_blocks - 1
        num_full = self.num_groups - len(self._sliding)
        if not self._sliding or not num_full:
            return usable * self.block_size
        window = sum(window_blocks(w, self.block_size) for _, w in self._sliding)
        return max(0, usable - window) // num_full * self.block_size

    def max_blocks_per_request(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Blocks, over all groups, that one request of `num_tokens` tokens holds at most when its steps run
        up to `step_tokens` tokens."""
        return blocks_per_request(self.windows, self.block_size, num_tokens, step_tokens)

    def max_concurrency(self, num_tokens: int) -> float:
        """How many requests of `num_tokens` tokens the cache holds at once."""
        if self.num_groups == 1 and not self._sliding:
            return self.capacity_tokens / num_tokens
        return (self.num_blocks - 1) / self.max_blocks_per_request(num_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """The longest cached prefix of the request's full blocks that every group has, and its length in
        tokens.

        Never covers the last known token (its logits must be computed), and finds nothing for requests
        that need every prompt position computed (prompt logprobs, MEAN or CLS pooling)."""
        if not self._uses_prefix_cache(request):
            return ComputedBlocks([[] for _ in self.windows]), 0
        n = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, n)
        keys: dict[int, tuple] = {}
        hits: list[list[KVBlock]] = [[] for _ in self.windows]
        settled = False
        while not settled:
            settled = True
            for window, groups in self._kinds:
                if window is None:
                    found = self._full_hit(request, groups, n, keys)
                elif isinstance(window, LocalChunk):
                    found = self._chunk_hit(request, groups, window, n, keys)
                else:
                    found = self._window_hit(request, groups, window, n, keys)
                for g, blocks in zip(groups, found, strict=True):
                    hits[g] = blocks
                if len(found[0]) < n:
                    n = len(found[0])
                    settled = len(self._kinds) == 1
        return ComputedBlocks([blocks[:n] for blocks in hits]), n * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give the request blocks, in every group, for `num_new_tokens` more tokens after its computed
        ones, first freeing what its sliding-window groups can no longer read.

        `computed_blocks` (from `get_computed_blocks`, only on the request's first allocation after
        admission) are taken as its leading blocks. Returns False, allocating nothing, when too few blocks
        are free; cached free blocks count as free."""
        hit = _hit_groups(computed_blocks)
        num_hit = len(hit[0]) if hit else 0
        request_id = request.request_id
        held = self._blocks.get(request_id)
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        if held is not None and self._sliding:
            self._free_skipped(request_id, num_computed)
        num_held = len(held[0]) if held is not None else 0
        per_group = max(0, _cdiv(num_computed + num_new_tokens, self.block_size) - num_held - num_hit)
        num_needed = per_group * self.num_groups
        num_revived = sum(1 for blocks in hit for block in blocks if block.ref_cnt == 0) if hit else 0
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        null = self.pool.null_block
        if hit:
            self.pool.touch(block for blocks in hit for block in blocks if block is not null)
        new_blocks = self.pool.get_new_blocks(num_needed)
        if held is None:
            held = self._blocks[request_id] = tuple([] for _ in self.windows)
            self._block_ids[request_id] = tuple([] for _ in self.windows)
            self._num_cached[request_id] = num_hit
            self._num_skipped[request_id] = [_leading_nulls(blocks, null) for blocks in hit or held]
            if self._uses_prefix_cache(request):
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit * self.block_size
        block_ids = self._block_ids[request_id]
        for g in range(self.num_groups):
            added = (hit[g] if hit else []) + new_blocks[g * per_group : (g + 1) * per_group]
            held[g].extend(added)
            block_ids[g].extend(block.block_id for block in added)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's blocks that `num_computed_tokens` fills findable by later requests."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        start = self._num_cached[request_id]
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request, end)
        held, null = self._blocks[request_id], self.pool.null_block
        for i in range(start, end):
            block_hash, key = request.block_hashes[i], self._block_key(request, i)
            for g, blocks in enumerate(held):
                if blocks[i] is not null:
                    self.pool.cache_block(blocks[i], block_hash if g == 0 else (g, block_hash), key)
        self._num_cached[request_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks; cached ones stay findable until reused. No-op if it holds none."""
        held = self._blocks.pop(request.request_id, None)
        if held is None:
            return
        del self._block_ids[request.request_id]
        del self._num_cached[request.request_id]
        del self._num_skipped[request.request_id]
        null = self.pool.null_block
        # last blocks first, over every group, so the tail (the least shared part) is evicted first
        self.pool.free_blocks(
            blocks[i] for i in reversed(range(len(held[0]))) for blocks in held if blocks[i] is not null
        )

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._blocks

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds over every group (freed ones, the null block, not counted)."""
        null = self.pool.null_block
        return sum(1 for blocks in self._blocks[request_id] for block in blocks if block is not null)

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
        """The request's block ids of group 0 in order; a live list that grows as blocks are added, do not
        modify."""
        return self._block_ids[request_id][0]

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one live list per group (0 where a sliding window freed the block)."""
        return self._block_ids[request_id]

    def _free_skipped(self, request_id: str, num_computed: int) -> None:
        """Free the blocks of each sliding-window group that the query at `num_computed` and every later one
        can no longer read, putting the null block in their place."""
        held, block_ids = self._blocks[request_id], self._block_ids[request_id]
        skipped, null = self._num_skipped[request_id], self.pool.null_block
        for g, window in self._sliding:
            if isinstance(window, LocalChunk):  # every later query reads from its chunk's start on
                first = num_computed // window * window
            else:
                first = max(0, num_computed - window + 1)
            start, end = skipped[g], min(first // self.block_size, len(held[g]))
            if end <= start:
                continue
            freed = [block for block in held[g][start:end] if block is not null]
            held[g][start:end] = [null] * (end - start)
            block_ids[g][start:end] = [0] * (end - start)
            skipped[g] = end
            self.pool.free_blocks(freed)

    def _cached_block(self, request: Request, i: int, g: int, keys: dict[int, tuple]) -> KVBlock | None:
        key = keys.get(i)
        if key is None:
            key = keys[i] = self._block_key(request, i)
        block_hash: Hashable = request.block_hashes[i]
        return self.pool.get_cached_block(block_hash if g == 0 else (g, block_hash), key)

    def _full_hit(self, request: Request, groups: list[int], n: int, keys: dict) -> list[list[KVBlock]]:
        """Full-attention groups: their blocks 0, 1, ... while every one of them has the block cached."""
        found: list[list[KVBlock]] = [[] for _ in groups]
        for i in range(n):
            blocks = [self._cached_block(request, i, g, keys) for g in groups]
            if any(block is None for block in blocks):
                break
            for f, block in zip(found, blocks, strict=True):
                f.append(block)
        return found

    def _window_hit(
        self, request: Request, groups: list[int], window: int, n: int, keys: dict
    ) -> list[list[KVBlock]]:
        """Sliding-window groups: the longest hit of at most n blocks whose last cdiv(window - 1,
        block_size) blocks (what a query right after it reads) every one of them has cached, or the
        blocks from 0 all cached, scanning from the right; the null block before those."""
        null = self.pool.null_block
        need = _cdiv(window - 1, self.block_size)
        found = [[null] * n for _ in groups]
        if need == 0:
            return found
        run = 0
        for i in range(n - 1, -1, -1):
            blocks = [self._cached_block(request, i, g, keys) for g in groups]
            if any(block is None for block in blocks):
                run = 0
                continue
            for f, block in zip(found, blocks, strict=True):
                f[i] = block
            run += 1
            if run >= need:
                return [f[: i + run] for f in found]
        return [f[:run] for f in found]  # no whole window: only blocks 0..run-1 all cached count

    def _chunk_hit(
        self, request: Request, groups: list[int], chunk: int, n: int, keys: dict
    ) -> list[list[KVBlock]]:
        """Chunked-local-attention groups: the longest hit of m <= n blocks whose blocks from the chunk start
        of position m * block_size up to m (what a query right after it reads) every one of them has cached;
        the null block before those. A missing block i rules out every m > i, so the scan goes on at i."""
        null, m = self.pool.null_block, n
        while m > 0:
            first = m * self.block_size // chunk * chunk // self.block_size
            found = [[null] * m for _ in groups]
            for i in range(m - 1, first - 1, -1):
                blocks = [self._cached_block(request, i, g, keys) for g in groups]
                if any(block is None for block in blocks):
                    m = i
                    break
                for f, block in zip(found, blocks, strict=True):
                    f[i] = block
            else:
                return found
        return [[] for _ in groups]

    def _uses_prefix_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching and not request.needs_every_prompt_position

    def _block_key(self, request: Request, i: int) -> tuple:
        parent = request.block_hashes[i - 1] if i else request.cache_salt
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(request.all_token_ids[start:end])
        if request.images:  # placeholder tokens are the same for every image: key them by content
            images = block_image_keys(request.images, start, end)
            if images:
                return parent, tokens, images
        return parent, tokens

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block_tokens(*self._block_key(request, i)))


def _hit_groups(computed_blocks: list[KVBlock] | None) -> tuple[list[KVBlock], ...] | None:
    """Every group's hit blocks; a plain list is a one-group manager's; None for no hit."""
    if not computed_blocks:
        return None
    return computed_blocks.groups if isinstance(computed_blocks, ComputedBlocks) else (computed_blocks,)


def _leading_nulls(blocks: list[KVBlock], null: KVBlock) -> int:
    n = 0
    while n < len(blocks) and blocks[n] is null:
        n += 1
    return n
