import pytest

from pagellm.engine import kv_cache_manager
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request
from pagellm.sampling.params import SamplingParams

BS = 4


def _req(rid, tokens, **params):
    return Request(rid, tokens, SamplingParams(**params))


def _admit(kv, request, num_new_tokens=None):
    """What the scheduler does on admission: look up the cache, allocate, record the hit."""
    blocks, num_hit = kv.get_computed_blocks(request)
    n = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    assert kv.allocate_slots(request, n, blocks)
    request.num_computed_tokens = num_hit
    return num_hit, n


def _compute(kv, request, n):
    """What the scheduler does after a step ran n tokens of the request."""
    request.num_computed_tokens += n
    kv.cache_blocks(request, request.num_computed_tokens)


def test_allocate_grow_and_free():
    kv = KVCacheManager(BS, 8)
    r = _req("a", range(10))
    assert kv.allocate_slots(r, 10)
    assert kv.block_table("a") == [1, 2, 3]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # still fits block 3
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.allocate_slots(r, 3)
    assert kv.block_table("a") == [1, 2, 3, 4]
    assert kv.num_free_blocks == 3
    assert kv.usage == pytest.approx(4 / 7)
    kv.free(r)
    assert kv.num_free_blocks == 7
    kv.free(r)  # a second free is a no-op


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(BS, 4)
    r = _req("a", range(20))
    assert not kv.allocate_slots(r, 13)  # needs 4 blocks, 3 usable
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 0


def test_shared_prefix_hits_and_ref_counts():
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(10)))
    _admit(kv, a)
    _compute(kv, a, 10)
    b = _req("b", list(range(8)) + [99, 98, 97])
    num_hit, n = _admit(kv, b)
    assert (num_hit, n) == (8, 3)
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_table("a")] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)


def test_hit_while_first_request_still_running():
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(20)))
    _admit(kv, a, num_new_tokens=8)  # a first prefill chunk
    assert kv.get_computed_blocks(_req("x", list(range(20))))[1] == 0  # not computed yet: no hit
    _compute(kv, a, 8)
    num_hit, _ = _admit(kv, _req("b", list(range(20))))
    assert num_hit == 8


def test_never_hits_the_last_token():
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    _compute(kv, a, 8)
    assert kv.pool.num_cached_blocks == 2
    blocks, num_hit = kv.get_computed_blocks(_req("b", list(range(8))))
    assert num_hit == 4 and len(blocks) == 1
    assert kv.get_computed_blocks(_req("c", list(range(9))))[1] == 8


def test_no_hit_for_prompt_logprobs_or_disabled():
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    _compute(kv, a, 12)
    assert kv.get_computed_blocks(_req("b", list(range(12)), prompt_logprobs=1)) == ([], 0)
    assert kv.get_computed_blocks(_req("d", list(range(12))))[1] == 8

    off = KVCacheManager(BS, 16, enable_prefix_caching=False)
    a = _req("a", list(range(12)))
    _admit(off, a)
    _compute(off, a, 12)
    assert off.pool.num_cached_blocks == 0
    assert off.get_computed_blocks(_req("b", list(range(12)))) == ([], 0)


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block_tokens", lambda parent, tokens: 42)
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    _compute(kv, a, 12)
    assert kv.pool.num_cached_blocks == 1  # every block collides; only the first is cached
    assert kv.get_computed_blocks(_req("b", [7] * 12))[1] == 0
    assert kv.get_computed_blocks(_req("c", list(range(12))))[1] == 4  # first block verified, second not


def test_block_hashes_are_computed_incrementally():
    kv = KVCacheManager(BS, 16)
    a = _req("a", list(range(6)))
    _admit(kv, a)
    _compute(kv, a, 6)
    hashes = list(a.block_hashes)
    assert len(hashes) == 1
    for token in (6, 7):
        a.append_output_token_id(token)
        assert kv.allocate_slots(a, 1)
        _compute(kv, a, 1)
    assert a.block_hashes[:1] == hashes and len(a.block_hashes) == 2
    # output tokens are cached too: a request continuing the conversation hits them
    assert kv.get_computed_blocks(_req("b", list(range(9))))[1] == 8


def test_freed_cached_blocks_are_found_until_reused_and_count_as_free():
    kv = KVCacheManager(BS, 5)  # 4 usable blocks
    a = _req("a", list(range(16)))
    _admit(kv, a)
    _compute(kv, a, 16)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 4
    b = _req("b", list(range(16)))
    num_hit, n = _admit(kv, b)  # 3 cached free blocks revived + 1 new (evicting a's last block)
    assert (num_hit, n) == (12, 4)
    assert kv.num_free_blocks == 0
    assert kv.pool.num_cached_blocks == 3
    kv.free(b)
    c = _req("c", list(range(100, 116)))
    _admit(kv, c)  # needs all 4 blocks: evicts every cached one
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(_req("d", list(range(16))))[1] == 0


def test_revived_blocks_need_free_room():
    kv = KVCacheManager(BS, 5)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    _compute(kv, a, 8)
    kv.free(a)
    filler = _req("f", list(range(50, 58)))
    assert kv.allocate_slots(filler, 8)  # takes the 2 uncached blocks; a's 2 cached are left
    b = _req("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert not kv.allocate_slots(b, 4, blocks)  # 2 revived + 1 new > 2 free
    assert kv.num_free_blocks == 2 and all(blk.ref_cnt == 0 for blk in blocks)


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_held_ones():
    from pagellm.engine.block_pool import BlockPool

    pool = BlockPool(6)
    held, free = pool.get_new_blocks(2), pool.get_new_blocks(2)
    for i, block in enumerate(held + free):
        pool.cache_block(block, 100 + i, ("k", i))
    pool.free_blocks(free)
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(102, ("k", 2)) is None and pool.get_cached_block(103, ("k", 3)) is None
    assert pool.get_cached_block(100, ("k", 0)) is held[0]
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
