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


# -- KV cache groups: sliding-window groups free what their window no longer reads ------------------------

W = 8  # a window of two 4-token blocks: a query at c reads c - 7 .. c


def _run(kv, request, n):
    """Allocate and compute n more tokens of the request (a prefill chunk, or a decode step's token)."""
    if request.num_computed_tokens >= request.num_prompt_tokens:
        for _ in range(n):
            request.append_output_token_id(1000 + request.num_tokens)
    assert kv.allocate_slots(request, n)
    _compute(kv, request, n)


def _evict(kv, request, i, g):
    """Forget the cached block i of group g of the request's prefix (as a reuse would)."""
    h = request.block_hashes[i]
    block = kv.pool._cached.pop(h if g == 0 else (g, h))
    block.block_hash = block.hash_key = None


def test_a_window_group_frees_the_blocks_behind_its_window():
    kv = KVCacheManager(BS, 32, windows=(None, W))
    r = _req("a", list(range(16)))
    _run(kv, r, 16)  # one chunk: all four blocks stay in both groups while it runs
    assert [len(t) for t in kv.block_tables("a")] == [4, 4] and kv.num_free_blocks == 31 - 8
    full, window = (list(t) for t in kv.block_tables("a"))
    _run(kv, r, 1)  # the query at 16 reads 9..16: blocks 0 and 1 (tokens 0..7) are behind it
    assert kv.block_tables("a")[0][:4] == full and len(kv.block_tables("a")[0]) == 5  # keeps everything
    assert kv.block_tables("a")[1][:2] == [0, 0] and kv.block_tables("a")[1][2:4] == window[2:]
    assert kv.num_held_blocks("a") == 5 + 3 and kv.num_free_blocks == 31 - 8
    for _ in range(7):
        _run(kv, r, 1)
    # the step at 23 reads 16..23, from block 4: blocks 0..3 are freed; 24 tokens are 6 blocks
    assert kv.block_tables("a")[1][:4] == [0, 0, 0, 0] and kv.num_held_blocks("a") == 6 + 2
    kv.free(r)
    assert kv.num_free_blocks == 31


def test_a_prefill_chunk_keeps_what_its_first_query_reads():
    kv = KVCacheManager(BS, 32, windows=(W,))
    r = _req("a", list(range(30)))
    _run(kv, r, 10)
    assert kv.allocate_slots(r, 12)  # the chunk 10..21: its first query reads 3..10, from block 0
    assert 0 not in kv.block_table("a")
    _compute(kv, r, 12)
    assert kv.allocate_slots(r, 8)  # the chunk 22..29 reads from 15: blocks 0..2 (tokens 0..11) go
    assert kv.block_table("a")[:4] == [0, 0, 0, kv.block_table("a")[3]] and kv.block_table("a")[3] != 0


def test_a_window_model_runs_a_context_that_would_not_fit_without_freeing():
    kv = KVCacheManager(BS, 5, windows=(W,))  # 4 usable blocks: 16 tokens without freeing
    r = _req("a", list(range(8)))
    _run(kv, r, 8)
    for _ in range(40):  # to 48 tokens: never more than three blocks held
        _run(kv, r, 1)
        assert kv.num_held_blocks("a") <= 3
    assert r.num_computed_tokens == 48 and kv.num_free_blocks >= 1
    keep_all = KVCacheManager(BS, 5, windows=(None,))  # the same window kept whole (a draft model reads it)
    s = _req("a", list(range(16)))
    _run(keep_all, s, 16)
    s.append_output_token_id(1)
    assert not keep_all.allocate_slots(s, 1)


def test_a_hit_needs_every_full_block_but_only_the_window_of_a_sliding_group():
    kv = KVCacheManager(BS, 64, windows=(None, W))
    a = _req("a", list(range(22)))
    _run(kv, a, 22)
    _run(kv, a, 1)  # a decode frees its window group's blocks 0..2; they stay cached
    kv.free(a)
    b = _req("b", list(range(21)))  # can hit 5 blocks (20 tokens)
    blocks, num_hit = kv.get_computed_blocks(b)
    null = kv.pool.null_block
    assert num_hit == 20
    assert all(block is not null for block in blocks.groups[0]) and blocks == blocks.groups[0]
    assert [block is null for block in blocks.groups[1]] == [True, True, True, False, False]
    assert kv.allocate_slots(b, 1, blocks)
    b.num_computed_tokens = 20
    assert kv.block_tables("b")[1][:3] == [0, 0, 0] and kv.num_held_blocks("b") == 6 + 3
    kv.free(b)
    # the window group lost block 4: its window for a hit at 16 (blocks 2 and 3) is still cached, so the
    # hit all groups agree on is 16 tokens
    _evict(kv, b, 4, 1)
    assert kv.get_computed_blocks(_req("c", list(range(21))))[1] == 16
    # and without block 2 of the window group, blocks 0..1 (from the start) are what is left
    _evict(kv, b, 2, 1)
    assert kv.get_computed_blocks(_req("d", list(range(21))))[1] == 8
    # a full group's missing block caps the hit for every group
    _evict(kv, b, 0, 0)
    assert kv.get_computed_blocks(_req("e", list(range(21))))[1] == 0


def test_window_groups_of_one_kind_are_hit_together():
    kv = KVCacheManager(BS, 64, windows=(None, W, W))
    a = _req("a", list(range(21)))
    _run(kv, a, 21)
    kv.free(a)
    assert kv.get_computed_blocks(_req("b", list(range(21))))[1] == 20
    _evict(kv, a, 4, 2)  # one of the two window groups lost the hit's last block
    blocks, num_hit = kv.get_computed_blocks(_req("c", list(range(21))))
    assert num_hit == 16 and [len(g) for g in blocks.groups] == [4, 4, 4]


def test_preempting_a_windowed_request_frees_its_blocks_and_it_finds_its_prefix_again():
    kv = KVCacheManager(BS, 32, windows=(None, W))
    r = _req("a", list(range(12)))
    _run(kv, r, 12)
    for _ in range(9):
        _run(kv, r, 1)
    assert kv.num_held_blocks("a") == 6 + 3
    kv.free(r)  # preemption: every block back, the null block untouched
    r.num_computed_tokens = 0
    assert kv.num_free_blocks == 31 and kv.pool.null_block.ref_cnt == 1
    num_hit, n = _admit(kv, r)
    assert (num_hit, n) == (20, 1) and kv.block_tables("a")[1][:3] == [0, 0, 0]


def test_gemma3_shaped_layers_hold_about_a_quarter_of_an_all_global_cache_at_8k():
    """The numbers in docs/architecture.md: 5 local (window 1024) : 1 global layers against 6 global, a
    prompt of 8192 tokens prefilled in 2048-token chunks, then its first decode step; and the longest
    prompt the memory of 1025 all-global blocks holds."""
    import torch

    from pagellm.core.attention import AttentionSpec
    from pagellm.core.kv_cache_spec import group_layers

    def layout(mixed):
        windows = [1024 if mixed and i % 6 != 5 else None for i in range(6)]
        return group_layers([AttentionSpec(8, 4, 256, torch.bfloat16, 16, sliding_window=w) for w in windows])

    def run(layout, num_blocks, context):
        kv = KVCacheManager(16, num_blocks, windows=layout.windows)
        r = _req("r", [i % 1000 for i in range(context)])
        while r.num_computed_tokens < context:
            if not kv.allocate_slots(r, min(2048, context - r.num_computed_tokens)):
                return r.num_computed_tokens, None
            _compute(kv, r, min(2048, context - r.num_computed_tokens))
        r.append_output_token_id(1)
        assert kv.allocate_slots(r, 1)
        return context, kv.num_held_blocks("r") * layout.layers_per_block  # layer pages

    glob, mixed = layout(False), layout(True)
    assert mixed.describe() == "KV cache: 6 groups of 1 layer: full (1 layer), sliding window 1024 (5 layers)"
    assert run(glob, 10**5, 8192)[1] == 513 * 6
    assert run(mixed, 10**5, 8192)[1] == 513 + 5 * 65  # 27% of it (19% at 32k, towards a sixth)
    # one memory: 6150 layer pages, 1025 blocks of 6 layers or 6150 of 1
    assert run(glob, 1025, 10**6)[0] == 16384
    assert run(mixed, 6150, 10**6)[0] == 81920
    assert KVCacheManager(16, 6150, windows=mixed.windows).capacity_tokens == 93184  # decoding


def test_a_chunked_group_frees_whole_chunks_once_every_query_is_past_them():
    from pagellm.core.kv_cache_spec import LocalChunk

    kv = KVCacheManager(BS, 32, windows=(None, LocalChunk(8)))  # chunks of two blocks
    r = _req("a", list(range(11)))
    _run(kv, r, 11)  # one prefill: positions 0..10, three blocks in each group, nothing freed yet
    assert [len(t) for t in kv.block_tables("a")] == [3, 3] and kv.num_held_blocks("a") == 6
    _run(kv, r, 1)  # the query at 11 reads 8..11 (its chunk): the first chunk's blocks 0 and 1 go
    assert kv.block_tables("a")[1][:2] == [0, 0] and 0 not in kv.block_tables("a")[0]
    assert kv.num_held_blocks("a") == 3 + 1
    for _ in range(4):  # to the query at 15: still the chunk 8..15
        _run(kv, r, 1)
    assert kv.block_tables("a")[1][2:4].count(0) == 0 and kv.num_held_blocks("a") == 4 + 2
    _run(kv, r, 1)  # the query at 16 starts a chunk: blocks 2 and 3 go, though a window of 8 would keep 3
    assert kv.block_tables("a")[1][:4] == [0, 0, 0, 0] and kv.num_held_blocks("a") == 5 + 1
    kv.free(r)
    assert kv.num_free_blocks == 31


def test_a_chunked_hit_needs_only_the_blocks_of_the_chunk_it_ends_in():
    from pagellm.core.kv_cache_spec import LocalChunk

    kv = KVCacheManager(BS, 64, windows=(None, LocalChunk(8)))
    a = _req("a", list(range(22)))
    _run(kv, a, 22)
    _run(kv, a, 1)  # the query at 22 reads 16..22: the chunked group frees blocks 0..3; they stay cached
    kv.free(a)
    null = kv.pool.null_block
    blocks, num_hit = kv.get_computed_blocks(_req("b", list(range(23))))  # can hit 5 blocks (20 tokens)
    assert num_hit == 20 and all(block is not null for block in blocks.groups[0])
    assert [block is null for block in blocks.groups[1]] == [True, True, True, True, False]
    # the chunked group lost block 4: a hit of 4 blocks (16 tokens) starts a chunk and needs none of it
    _evict(kv, a, 4, 1)
    blocks, num_hit = kv.get_computed_blocks(_req("c", list(range(23))))
    assert num_hit == 16 and all(block is null for block in blocks.groups[1])
    # a hit of 3 blocks (12 tokens) would need block 2, the chunk 8..15's first: it is cached, but 16 is
    # still the longest, so losing block 2 changes nothing ...
    _evict(kv, a, 2, 1)
    assert kv.get_computed_blocks(_req("d", list(range(23))))[1] == 16
    # ... while a prompt that ends inside that chunk finds only the hit that starts it (8 tokens)
    assert kv.get_computed_blocks(_req("e", list(range(14))))[1] == 8
    # and a full group's missing block caps the hit for every group
    _evict(kv, a, 0, 0)
    assert kv.get_computed_blocks(_req("f", list(range(23))))[1] == 0


def test_a_chunk_group_is_not_a_window_group_of_the_same_size():
    import torch

    from pagellm.core.attention import AttentionSpec
    from pagellm.core.kv_cache_spec import LocalChunk, group_layers

    spec = AttentionSpec(4, 2, 16, torch.float32)
    chunked = AttentionSpec(4, 2, 16, torch.float32, attention_chunk=8)
    layout = group_layers([chunked, spec, AttentionSpec(4, 2, 16, torch.float32, sliding_window=8)])
    assert layout.windows == (None, 8, LocalChunk(8)) and isinstance(layout.windows[2], LocalChunk)
    assert layout.groups[2].layers == (0,) and "chunked local attention 8" in layout.describe()
    kv = KVCacheManager(BS, 32, windows=layout.windows)
    assert len(kv._kinds) == 3
