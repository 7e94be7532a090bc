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
