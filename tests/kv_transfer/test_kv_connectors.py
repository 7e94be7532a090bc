"""KV connectors between two engines in this process (a prefill engine and a decode engine, stepped in turn):
the decode engine's greedy tokens equal one engine's, the KV it loads equals what it would have computed bit
for bit (float32), and every fault (a missing, truncated or corrupt transfer, a dead or silent peer, an
abort or a preemption mid-way) ends in a recompute with no block held afterwards on either side."""

from __future__ import annotations

import os
import time

import pytest
import torch
from kvt_harness import (
    BLOCK,
    DECODE,
    LOADED,
    NUM_BLOCKS,
    PROMPTS,
    greedy,
    make_engine,
    prompt_of,
    run,
    storage,
    zmq,
)

from pagellm.core.errors import ConfigError
from pagellm.core.kv_connector import KVCacheBlocks, block_digests, kv_block_dim
from pagellm.engine.request import Request, RequestStatus
from pagellm.plugins import load_plugins


def settle(*engines, timeout=10.0) -> None:
    """Step until no engine has work or transfers in flight (a producer frees what was read, or timed out)."""
    deadline = time.monotonic() + timeout
    while any(e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < deadline, "transfers still in flight"
        for e in engines:
            if e.has_unfinished_requests():
                e.step()


def assert_no_leak(*engines) -> None:
    settle(*engines)
    for engine in engines:
        assert engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1


@pytest.fixture(scope="module")
def expected(reference):
    """Each prompt's greedy tokens from one plain engine, one request at a time."""
    return {tuple(p): run(reference, p).outputs[0].token_ids for p in PROMPTS}


def kv_blocks(engine) -> KVCacheBlocks:
    spec = engine.setup.spec
    dim = kv_block_dim(engine.setup.backend.kv_cache_shape, BLOCK, spec.num_kv_heads, spec.cache_row_size)
    return KVCacheBlocks(engine.runner.kv_caches, dim)


def cached_kv(engine, prompt) -> list[torch.Tensor]:
    """Each layer's KV of the prompt's blocks before its last token, as found in the engine's prefix cache."""
    blocks, hit = engine.scheduler.kv_cache_manager.get_computed_blocks(Request("probe", prompt, greedy(1)))
    num_blocks = (len(prompt) - 1) // BLOCK
    assert hit >= num_blocks * BLOCK
    ids = [b.block_id for b in blocks[:num_blocks]]
    caches = kv_blocks(engine)
    return [caches.read(layer, ids) for layer in range(caches.num_layers)]


def assert_same_kv(decode, reference, prompt) -> None:
    for loaded, computed in zip(cached_kv(decode, prompt), cached_kv(reference, prompt), strict=True):
        assert loaded.dtype == torch.float32 and torch.equal(loaded, computed)


@pytest.mark.parametrize(
    "kv, overrides, message",
    [
        ('{"kv_connector": "nope"}', {}, "installed: shared_storage, zmq"),
        ('{"kv_connector": "zmq", "kv_role": "decoder"}', {}, "kv_role"),
        ('{"kv_connector": "zmq", "port": 1}', {}, "unknown key(s) port"),
        ("{kv_connector: zmq}", {}, "not valid JSON"),
        ('{"kv_connector": "zmq"}', {"enable_prefix_caching": False}, "prefix caching"),
        ('{"kv_connector": "shared_storage"}', {}, "shared_storage_path"),
        ('{"kv_connector": "zmq", "kv_connector_extra_config": {"recv_timeout_s": 0}}', {}, "recv_timeout_s"),
        ('{"kv_connector": "zmq"}', {"tensor_parallel_size": 2}, "tensor or pipeline parallelism"),
    ],
)
def test_a_kv_transfer_config_that_cannot_work_fails_at_start_up(model_dir, kv, overrides, message):
    from pagellm.core.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS, kv_transfer_config=kv, **overrides
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLMEngine(config)


def test_every_attention_backend_layout_has_a_block_dimension():
    for name, backend in load_plugins().attention_backends.items():
        dim = kv_block_dim(backend.kv_cache_shape, BLOCK, 2, 16)
        assert backend.kv_cache_shape(7, BLOCK, 2, 16)[dim] == 7, name


def test_shared_storage_decode_equals_one_engine_and_loads_the_kv_it_would_compute(
    model_dir, reference, expected, tmp_path
):
    prefill = make_engine(model_dir, storage("kv_producer", tmp_path))
    decode = make_engine(model_dir, storage("kv_consumer", tmp_path))
    for prompt in PROMPTS:
        assert run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params is None
    assert len(list(tmp_path.rglob("*.safetensors"))) == sum(len(p) // BLOCK for p in PROMPTS)
    for prompt in PROMPTS:
        assert run(decode, prompt).outputs[0].token_ids == expected[tuple(prompt)]
    stats = decode.stats()
    assert stats.kv_transfer_loaded_tokens == stats.prefix_cache_hits == sum(LOADED)
    assert stats.kv_transfer_load_failures == 0
    assert decode.runner.kv_connector.bytes_loaded == sum(LOADED) // BLOCK * decode.runner.block_bytes()
    for prompt in PROMPTS[1:]:
        assert_same_kv(decode, reference, prompt)
    assert_no_leak(prefill, decode)


def test_zmq_decode_equals_one_engine_and_the_producer_frees_what_was_read(model_dir, reference, expected):
    prefill = make_engine(model_dir, zmq("kv_producer"))
    decode = make_engine(model_dir, zmq("kv_consumer"))
    for prompt, loaded in zip(PROMPTS, LOADED, strict=True):
        params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
        if loaded == 0:
            assert params is None  # less than a block before the last token: nothing to hold
        else:
            assert len(params["remote_block_ids"]) == loaded // BLOCK and params["remote_port"] > 0
        out = run(decode, prompt, others=[prefill], kv_transfer_params=params)
        assert out.outputs[0].token_ids == expected[tuple(prompt)]
    assert decode.stats().kv_transfer_loaded_tokens == decode.stats().prefix_cache_hits == sum(LOADED)
    moved = sum(LOADED) // BLOCK * decode.runner.block_bytes()
    assert prefill.runner.kv_connector.bytes_sent == decode.runner.kv_connector.bytes_received == moved
    for prompt in PROMPTS[1:]:
        assert_same_kv(decode, reference, prompt)
    assert_no_leak(prefill, decode)
    prefill.shutdown()
    decode.shutdown()


def test_a_truncated_or_deleted_storage_file_is_recomputed(model_dir, expected, tmp_path):
    prefill = make_engine(model_dir, storage("kv_producer", tmp_path))
    decode = make_engine(model_dir, storage("kv_both", tmp_path))
    truncated, deleted = PROMPTS[3], PROMPTS[4]
    for prompt in (truncated, deleted):
        run(prefill, prompt, 1)
    directory = prefill.runner.kv_connector.directory
    namespace = prefill.runner.kv_context.namespace

    def path(prompt, i):
        return os.path.join(
            directory, block_digests(prompt, BLOCK, i + 1, None, namespace)[i] + ".safetensors"
        )

    with open(path(truncated, 1), "r+b") as f:
        f.truncate(os.path.getsize(path(truncated, 1)) // 2)
    os.remove(path(deleted, 0))
    assert run(decode, truncated).outputs[0].token_ids == expected[tuple(truncated)]
    assert decode.stats().kv_transfer_load_failures == 1
    assert decode.stats().kv_transfer_loaded_tokens == BLOCK  # the block before the truncated one
    assert run(decode, deleted).outputs[0].token_ids == expected[tuple(deleted)]
    assert decode.stats().kv_transfer_loaded_tokens == BLOCK  # no first block: nothing to load
    assert_no_leak(prefill, decode)


def test_a_truncated_answer_a_dead_producer_and_a_late_read_are_recomputed(model_dir, expected, monkeypatch):
    prefill = make_engine(model_dir, zmq("kv_producer", send_timeout_s=0.5))
    decode = make_engine(model_dir, zmq("kv_consumer", recv_timeout_s=0.5))
    prompt = PROMPTS[3]

    server = prefill.runner.kv_connector
    answer = server._answer
    monkeypatch.setattr(server, "_answer", lambda m: (f := answer(m)) and [*f[:-1], bytes(f[-1])[:-8]])
    params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
    assert (
        run(decode, prompt, others=[prefill], kv_transfer_params=params).outputs[0].token_ids
        == expected[tuple(prompt)]
    )
    assert decode.stats().kv_transfer_load_failures == 1
    monkeypatch.undo()

    params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
    settle(prefill)  # nobody reads it: freed after send_timeout_s
    assert prefill.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1
    decode.reset_prefix_cache()
    assert (
        run(decode, prompt, others=[prefill], kv_transfer_params=params).outputs[0].token_ids
        == expected[tuple(prompt)]
    )
    assert decode.stats().kv_transfer_load_failures == 2  # the producer answered "gone"

    params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
    prefill.shutdown()  # a dead producer answers nothing: the read times out
    decode.reset_prefix_cache()
    started = time.monotonic()
    assert run(decode, prompt, kv_transfer_params=params).outputs[0].token_ids == expected[tuple(prompt)]
    assert decode.stats().kv_transfer_load_failures == 3 and time.monotonic() - started < 5
    assert decode.stats().kv_transfer_loaded_tokens == 0
    assert_no_leak(decode)
    decode.shutdown()


def test_a_decode_engine_that_needs_none_of_the_blocks_releases_them_at_once(model_dir, expected):
    prefill = make_engine(model_dir, zmq("kv_producer"))  # holds unread blocks for 120 s
    decode = make_engine(model_dir, zmq("kv_consumer"))
    prompt = PROMPTS[2]
    run(decode, prompt)  # the decode engine has the prompt in its own prefix cache
    params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
    assert (
        run(decode, prompt, others=[prefill], kv_transfer_params=params).outputs[0].token_ids
        == expected[tuple(prompt)]
    )
    assert decode.stats().kv_transfer_loaded_tokens == 0
    assert_no_leak(prefill, decode)  # within settle's 10 s: released, not timed out
    prefill.shutdown()
    decode.shutdown()


def test_a_preempted_decode_request_keeps_what_it_received(model_dir, reference):
    prefill = make_engine(model_dir, zmq("kv_producer"))
    decode = make_engine(model_dir, zmq("kv_consumer"), num_kv_blocks=10)  # 9 blocks: not enough for both
    first, loaded = prompt_of(40, 7), prompt_of(50, 8)
    want = {
        "a": run(reference, first, 60).outputs[0].token_ids,
        "b": run(reference, loaded, 40).outputs[0].token_ids,
    }
    params = run(prefill, loaded, 1, kv_transfer_params=DECODE).kv_transfer_params
    decode.add_request(first, greedy(60), request_id="a")
    decode.add_request(loaded, greedy(40), request_id="b", kv_transfer_params=params)
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got.update({o.request_id: o.outputs[0].token_ids for o in decode.step() if o.finished})
        if prefill.has_unfinished_requests():
            prefill.step()
    assert got == want
    stats = decode.stats()
    assert stats.num_preemptions > 0 and stats.kv_transfer_loaded_tokens == 48  # received once, never again
    assert prefill.runner.kv_connector.bytes_sent == 3 * prefill.runner.block_bytes()
    settle(prefill, decode)
    assert decode.scheduler.kv_cache_manager.num_free_blocks == 9
    assert prefill.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1
    prefill.shutdown()
    decode.shutdown()


def test_an_aborted_request_frees_its_blocks_once_its_load_ends(model_dir):
    prefill = make_engine(model_dir, zmq("kv_producer"))
    decode = make_engine(model_dir, zmq("kv_consumer", recv_timeout_s=0.3))
    prompt = PROMPTS[3]
    params = run(prefill, prompt, 1, kv_transfer_params=DECODE).kv_transfer_params
    prefill.shutdown()  # the read will never be answered
    request_id = decode.add_request(prompt, greedy(4), kv_transfer_params=params)
    decode.step()
    [engine_id] = decode.output_processor.child_ids(request_id)  # the scheduler's id of it
    assert decode.scheduler.requests[engine_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.abort_request(request_id)
    assert decode.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1 - 3  # still being filled
    assert_no_leak(decode)
    decode.shutdown()
