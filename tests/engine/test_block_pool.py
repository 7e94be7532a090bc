import pytest

from pagellm.engine.block_pool import BlockPool


def _free_order(pool: BlockPool) -> list[int]:
    """Drain the free queue to see its order (allocation takes from the head)."""
    return [b.block_id for b in pool.get_new_blocks(pool.num_free_blocks)]


def test_initial_state_reserves_null_block():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(7)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5, 6, 7]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)


def test_free_and_ref_counts():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # shared by a second request
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert pool.num_free_blocks == 4
    pool.free_blocks([a])
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0


def test_lru_eviction_order_and_eviction_drops_hash():
    pool = BlockPool(6)
    old = pool.get_new_blocks(2)  # 1, 2
    new = pool.get_new_blocks(3)  # 3, 4, 5
    for i, block in enumerate(old + new):
        assert pool.cache_block(block, 100 + i, ("key", i))
    pool.free_blocks(reversed(old))  # freed first: evicted first, a request's last block before its first
    pool.free_blocks(reversed(new))
    assert pool.num_cached_blocks == 5
    assert pool.get_cached_block(104, ("key", 4)) is new[2]  # free but still findable
    assert pool.get_new_blocks(1)[0] is old[1]
    assert pool.get_cached_block(101, ("key", 1)) is None  # reused: evicted
    assert pool.num_cached_blocks == 4
    assert _free_order(pool) == [1, 5, 4, 3]


def test_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    cached, plain = pool.get_new_blocks(2)
    pool.cache_block(cached, 7, ("k",))
    pool.free_blocks([plain, cached])
    assert _free_order(pool) == [2, 3, 4, 1]


def test_touch_takes_cached_free_block_out_of_free_queue():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 5, ("k",))
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block.block_id not in [b.block_id for b in pool.get_new_blocks(2)]
    assert block.block_hash == 5


def test_cache_lookup_checks_key_and_duplicate_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 9, (None, (1, 2), ()))
    assert not pool.cache_block(b, 9, (None, (3, 4), ()))  # hash taken: b stays uncached
    assert b.block_hash is None
    assert pool.get_cached_block(9, (None, (1, 2), ())) is a
    assert pool.get_cached_block(9, (None, (3, 4), ())) is None  # collision: a miss, not wrong KV
    assert pool.get_cached_block(8, (None, (1, 2), ())) is None


def test_allocation_order_follows_the_rules():
    """Freed uncached blocks (most recently freed first), then never-used blocks (by id), then freed cached
    blocks (least recently freed first); reading a never-used block or forgetting the cache moves nothing."""
    pool = BlockPool(12)
    held = pool.get_new_blocks(6)  # 1..6; 7..11 never used
    assert [b.block_id for b in held] == [1, 2, 3, 4, 5, 6]
    assert pool.blocks[9].ref_cnt == 0 and pool.num_free_blocks == 5  # a read is not an allocation
    for block in (held[0], held[2], held[4]):  # 1, 3, 5 cached
        pool.cache_block(block, block.block_id, (block.block_id,))
    pool.free_blocks([held[4], held[1], held[0], held[5], held[2], held[3]])  # 5, 2, 1, 6, 3, 4
    plain = [4, 6, 2]  # uncached, most recently freed first
    never_used = [7, 8, 9, 10, 11]
    cached = [5, 1, 3]  # least recently freed first
    assert pool.num_free_blocks == 11 and pool.num_cached_blocks == 3
    assert pool.reset_prefix_cache() == 3  # uncached now, but they keep their place
    assert [b.block_id for b in pool.get_new_blocks(11)] == plain + never_used + cached


def test_touch_and_eviction_follow_the_rules_across_the_never_used_range():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)  # 1, 2, 3; 4, 5 never used
    pool.cache_block(a, 10, ("a",))
    pool.cache_block(b, 20, ("b",))
    pool.free_blocks([a, c, b])
    pool.touch([pool.get_cached_block(10, ("a",))])  # revived: out of the free queue, still cached
    assert a.ref_cnt == 1 and pool.num_free_blocks == 4 and pool.usage == pytest.approx(0.2)
    assert [x.block_id for x in pool.get_new_blocks(3)] == [3, 4, 5]  # the cache is not evicted yet
    assert pool.get_cached_block(20, ("b",)) is b
    assert pool.get_new_blocks(1) == [b] and pool.get_cached_block(20, ("b",)) is None  # now it is
    assert pool.get_cached_block(10, ("a",)) is a


def test_ten_million_blocks_start_in_constant_time_and_memory():
    """A large accelerator's KV cache has millions of blocks (issue 17): one Python object per block made
    start-up take ~9 s and ~1.8 GB at 10M blocks."""
    import time
    import tracemalloc

    from pagellm.engine.kv_cache_manager import KVCacheManager

    num_blocks = 10_000_000
    tracemalloc.start()
    try:
        started = time.perf_counter()
        pool = BlockPool(num_blocks)
        kv = KVCacheManager(16, num_blocks)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0 and peak < 50 << 20
    assert pool.num_free_blocks == kv.num_free_blocks == num_blocks - 1 and len(pool.blocks) == num_blocks
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and pool.blocks[-1].block_id == num_blocks - 1
    pool.free_blocks(blocks)
    assert pool.usage == 0.0
