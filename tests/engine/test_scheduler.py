import random

import pytest

from pagellm.core.errors import ConfigError
from pagellm.engine.request import Request, RequestStatus
from pagellm.engine.scheduler import Scheduler
from pagellm.sampling.params import SamplingParams


def _sched(**kw):
    args = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=128,
        enable_prefix_caching=True, enable_chunked_prefill=True, policy="fcfs",
    )  # fmt: skip
    args.update(kw)
    return Scheduler(**args)


def _req(rid, n_prompt, max_tokens=4, eos=(), priority=0, arrival=None, first_token=0, **params):
    tokens = list(range(first_token, first_token + n_prompt))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params), eos, arrival, priority)


def _step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, {r.request_id: [token] for r in out.scheduled})
    return out


def _run(s, max_steps=1000):
    outs = []
    while s.has_unfinished_requests():
        outs.append(_step(s))
        assert len(outs) < max_steps
    return outs


def test_chunked_prefill_splits_a_long_prompt_within_budget():
    s = _sched(max_num_batched_tokens=32)
    r = _req("a", 100, max_tokens=3)
    s.add_request(r)
    counts, outputs = [], []
    while s.has_unfinished_requests():
        out = _step(s)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 32
        counts.append(out.num_scheduled_tokens["a"])
        outputs.append(r.num_output_tokens)
    assert counts == [32, 32, 32, 4, 1, 1]
    assert outputs == [0, 0, 0, 1, 2, 3]  # partial chunks sample nothing
    assert r.output_token_ids == [7, 7, 7]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
    assert r.first_scheduled_time <= r.first_token_time <= r.finished_time


def test_without_chunking_a_long_prompt_runs_whole_and_others_wait():
    s = _sched(max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(_req("a", 100))
    s.add_request(_req("b", 40, first_token=500))
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 100}  # budget raised to max_model_len; b does not fit now
    out = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}


def test_decodes_go_before_new_prefills():
    s = _sched(max_num_batched_tokens=16)
    s.add_request(_req("a", 5, max_tokens=10))
    s.add_request(_req("b", 5, max_tokens=10))
    first = _step(s)
    assert first.new_request_ids == {"a", "b"}
    s.add_request(_req("c", 50))
    out = _step(s)
    assert [r.request_id for r in out.scheduled] == ["a", "b", "c"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 14}
    assert out.new_request_ids == {"c"}


def test_max_num_seqs():
    s = _sched(max_num_seqs=2)
    for i in range(5):
        s.add_request(_req(f"r{i}", 3, max_tokens=2))
    outs = _run(s)
    assert all(len(o.scheduled) <= 2 for o in outs)
    assert s.num_running == s.num_waiting == 0


def _preemption_setup(**kw):
    # 4 usable blocks of 4 tokens: two 8-token prompts fill them; the next block forces a preemption
    s = _sched(block_size=4, num_blocks=5, max_model_len=16, **kw)
    a, b = _req("a", 6, max_tokens=6), _req("b", 8, max_tokens=6, first_token=100)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    return s, a, b


def test_preempts_newest_which_resumes_and_finishes():
    s, a, b = _preemption_setup()
    out = _step(s)  # a still fits its 2 blocks; b needs a third: b is the victim of itself
    assert out.preempted == ["b"] and list(out.num_scheduled_tokens) == ["a"]
    assert s.num_preemptions == 1 and s.stats().num_preemptions == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]
    resumed = None
    for out in _run(s):
        if "b" in out.new_request_ids:
            resumed = out
    assert resumed is not None and resumed.num_scheduled_tokens["b"] < 9  # its own blocks were cached
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert s.kv_cache_manager.num_free_blocks == 4


def test_priority_preempts_lowest_priority_even_if_scheduled():
    s = _sched(block_size=4, num_blocks=5, max_model_len=16, policy="priority")
    low = _req("low", 8, max_tokens=6, priority=5, arrival=0.0)
    s.add_request(low)
    _step(s)
    high = _req("high", 4, max_tokens=6, priority=0, arrival=1.0, first_token=100)
    s.add_request(high)
    out = _step(s)
    assert out.num_scheduled_tokens == {"low": 1, "high": 4}  # every block in use now
    out = _step(s)
    assert out.preempted == ["low"]
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    _run(s)
    assert low.num_output_tokens == high.num_output_tokens == 6


def test_priority_order_of_waiting_requests():
    s = _sched(max_num_seqs=1, policy="priority")
    for rid, prio, t in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", -1, 3.0)]:
        s.add_request(_req(rid, 3, max_tokens=1, priority=prio, arrival=t))
    order = [next(iter(o.new_request_ids)) for o in _run(s)]
    assert order == ["d", "b", "a", "c"]


def test_abort_waiting_and_running_frees_everything():
    s = _sched(max_num_seqs=1)
    a, b = _req("a", 10, max_tokens=5), _req("b", 10)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    assert s.kv_cache_manager.num_free_blocks < 127
    s.abort_request("b")
    s.abort_request("a")
    s.abort_request("a")  # already gone: ignored
    assert not s.has_unfinished_requests() and s.get_num_unfinished_requests() == 0
    assert a.finish_reason == b.finish_reason == "abort"
    assert s.kv_cache_manager.num_free_blocks == 127
    out = s.schedule()
    assert out.is_empty and out.finished_ids == {"a", "b"}


def test_abort_between_schedule_and_update():
    s = _sched()
    a = _req("a", 10)
    s.add_request(a)
    out = s.schedule()
    s.abort_request("a")
    assert s.update_from_output(out, {"a": [1]}) == []
    assert a.output_token_ids == [] and s.kv_cache_manager.num_free_blocks == 127


@pytest.mark.parametrize(
    "params, eos, tokens, outputs, status, stop_reason",
    [
        ({}, (2,), [5, 2, 5], [5, 2], RequestStatus.FINISHED_STOPPED, None),
        ({"min_tokens": 3}, (2,), [2, 2, 2, 2], [2, 2, 2], RequestStatus.FINISHED_STOPPED, None),
        (
            {"ignore_eos": True, "max_tokens": 3},
            (2,),
            [2, 2, 2, 2],
            [2, 2, 2],
            RequestStatus.FINISHED_LENGTH,
            None,
        ),
        ({"stop_token_ids": [9]}, (2,), [5, 9, 5], [5, 9], RequestStatus.FINISHED_STOPPED, 9),
        (
            {"max_tokens": None},
            (),
            [1] * 20,
            [1] * 6,
            RequestStatus.FINISHED_LENGTH,
            None,
        ),  # max_model_len 16
        ({"max_tokens": 2}, (), [5, 2, 5], [5, 2], RequestStatus.FINISHED_LENGTH, None),
    ],
)
def test_stop_conditions(params, eos, tokens, outputs, status, stop_reason):
    s = _sched(max_model_len=16)
    r = Request("r", list(range(10)), SamplingParams(**{"max_tokens": 10, **params}), eos)
    s.add_request(r)
    out = s.schedule()
    updated = s.update_from_output(out, {"r": tokens})  # several tokens a step, as with speculation
    assert updated == [r]
    assert r.output_token_ids == outputs
    assert r.status == status and r.stop_reason == stop_reason
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_blocks == 127


def test_finish_request_from_a_stop_string():
    s = _sched()
    r = _req("r", 5, max_tokens=10)
    s.add_request(r)
    _step(s)
    s.finish_request("r", RequestStatus.FINISHED_STOPPED, "END")
    assert r.finish_reason == "stop" and r.stop_reason == "END"
    assert s.num_running == 0 and s.kv_cache_manager.num_free_blocks == 127


def test_stats_and_prefix_hits_across_requests():
    s = _sched()
    s.add_request(_req("a", 20, max_tokens=5))
    _step(s)
    b = _req("b", 20, max_tokens=2)
    s.add_request(b)
    out = _step(s)
    assert out.num_scheduled_tokens["b"] == 4 and b.num_cached_tokens == 16
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 16)
    assert stats.num_running == 2 and stats.num_waiting == 0 and 0 < stats.kv_cache_usage < 1


def test_bad_settings():
    with pytest.raises(ConfigError, match="max_model_len"):
        _sched(num_blocks=10, max_model_len=64)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        _sched(max_num_seqs=100, max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="fcfs or priority"):
        _sched(policy="lifo")
    with pytest.raises(ValueError, match="prompt tokens"):
        _sched().add_request(_req("r", 200))


@pytest.mark.parametrize("seed", range(24))
def test_random_simulation(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    max_model_len = 96
    num_blocks = max_model_len // bs + 1 + rng.randint(0, max_model_len // bs)
    max_num_seqs = rng.randint(1, 8)
    budget = rng.randint(max_num_seqs, 80)
    chunked = rng.random() < 0.7
    s = Scheduler(max_num_seqs, budget, max_model_len, bs, num_blocks, rng.random() < 0.8, chunked,
                  rng.choice(["fcfs", "priority"]))  # fmt: skip
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(0, 40))] for _ in range(3)]
    pending = []
    for i in range(rng.randint(5, 25)):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        pending.append(Request(f"r{i}", prompt, params, eos_token_ids=(3,), priority=rng.randint(0, 2)))
    all_requests = list(pending)
    aborted = set()
    kv_store = {}  # slot -> the token prefix whose KV it holds, as a fake model would write it

    for _ in range(5000):
        if not (pending or s.has_unfinished_requests()):
            break
        for _ in range(rng.randint(0, 2)):
            if pending:
                s.add_request(pending.pop(0))
        out = s.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= s.token_budget
        assert len(out.scheduled) <= max_num_seqs
        for r in out.scheduled:
            n, start, table = (
                out.num_scheduled_tokens[r.request_id],
                r.num_computed_tokens,
                out.block_ids[r.request_id],
            )
            assert n > 0 and start + n <= r.num_tokens and len(table) * bs >= start + n
            assert 0 not in table
            tokens = r.all_token_ids
            for p in range(start + n):
                slot = table[p // bs] * bs + p % bs
                if p < start:  # computed earlier or a prefix-cache hit: must hold this exact prefix
                    assert kv_store[slot] == tuple(tokens[: p + 1])
                else:
                    kv_store[slot] = tuple(tokens[: p + 1])
        if out.scheduled and rng.random() < 0.03:
            victim = rng.choice(out.scheduled).request_id
            s.abort_request(victim)
            aborted.add(victim)
        s.update_from_output(
            out, {r.request_id: [rng.choice([3, rng.randrange(1000)])] for r in out.scheduled}
        )
    else:
        pytest.fail("simulation did not finish")

    pool = s.kv_cache_manager.pool
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    for r in all_requests:
        assert r.is_finished
        if r.request_id not in aborted:
            assert r.num_output_tokens == r.sampling_params.max_tokens
            assert r.finish_reason == "length"


def test_stats_count_the_lora_requests_running_and_their_adapters():
    from pagellm.lora.request import LoRARequest

    s = _sched(max_loras=2)
    one, two = LoRARequest("one", 1, "/one"), LoRARequest("two", 2, "/two")
    for rid, lora in (("a", one), ("b", one), ("c", two), ("d", None)):
        request = _req(rid, 6, max_tokens=3)
        request.lora_request = lora
        s.add_request(request)
    assert (s.stats().num_lora_requests_running, s.stats().num_loras_active) == (0, 0)  # all waiting
    _step(s)
    assert (s.stats().num_lora_requests_running, s.stats().num_loras_active) == (3, 2)
    s.abort_request("c")
    assert (s.stats().num_lora_requests_running, s.stats().num_loras_active) == (2, 1)
    _run(s)
    assert (s.stats().num_lora_requests_running, s.stats().num_loras_active) == (0, 0)
