"""`pagellm bench soak`: the traffic mix drawn from a seed, the accounting that decides whether a request was
answered exactly once, the cross-check with the server's counts, the memory check, and (slow) a short soak
against a tiny model whose checks must all pass."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter

import pytest

from pagellm.bench import soak
from pagellm.bench.soak import Mix, Outcome, Planned


def plans(seed: int, count: int, num_adapters: int = 2) -> list[Planned]:
    return list(itertools.islice(soak.plan_requests(seed, Mix(), num_adapters, (10, 50), (4, 8)), count))


def test_the_traffic_mix_is_drawn_from_the_seed_in_its_fractions():
    drawn = plans(0, 4000)
    assert drawn == plans(0, 4000) and drawn != plans(1, 4000)
    mix = Mix()
    kinds = Counter(p.kind for p in drawn)
    assert kinds["malformed"] / 4000 == pytest.approx(mix.malformed, abs=0.01)
    assert kinds["huge"] / 4000 == pytest.approx(mix.huge, abs=0.005)
    valid = [p for p in drawn if p.kind == "valid"]
    streams = [p for p in valid if p.stream]
    fraction = lambda part, whole: len(part) / len(whole)  # noqa: E731
    assert fraction(streams, valid) == pytest.approx(mix.stream, abs=0.03)
    assert fraction([p for p in streams if p.drop_after], streams) == pytest.approx(mix.drop, abs=0.02)
    assert all(1 <= p.drop_after <= 3 for p in streams if p.drop_after)
    assert not any(p.drop_after for p in valid if not p.stream)
    assert fraction([p for p in valid if p.chat], valid) == pytest.approx(mix.chat, abs=0.03)
    assert fraction([p for p in valid if p.n == 2], valid) == pytest.approx(mix.n2, abs=0.02)
    assert fraction([p for p in valid if p.prefix is not None], valid) == pytest.approx(
        mix.shared_prefix, abs=0.03
    )
    assert {p.prefix for p in valid} == {None, *range(soak.PREFIXES)}
    assert Counter(p.adapter for p in valid if p.adapter is not None).keys() == {0, 1}
    assert fraction([p for p in valid if p.adapter is not None], valid) == pytest.approx(mix.lora, abs=0.03)
    assert not any(p.structured == "tools" for p in valid if not p.chat)  # tools are chat's
    chat = [p for p in valid if p.chat]
    assert fraction([p for p in chat if p.structured == "tools"], chat) == pytest.approx(mix.tools, abs=0.02)
    assert all(10 <= p.own_chars <= 50 and 4 <= p.max_tokens <= 8 for p in valid)
    assert not any(p.adapter is not None for p in plans(0, 500, num_adapters=0))


def test_bodies_fit_the_context_or_break_it_as_planned():
    from pydantic import ValidationError

    from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest

    target = soak.Target("http://x", "base", ("a0", "a1"), max_model_len=512)
    target, own = soak.with_prefixes(target, max_tokens=16, seed=0)
    malformed = set()
    for plan in plans(3, 2000):
        body = target.body(plan)
        schema = ChatCompletionRequest if plan.chat else CompletionRequest
        if plan.kind == "malformed":
            with pytest.raises((json.JSONDecodeError, ValidationError)):
                schema.model_validate(json.loads(body))
            malformed.add((plan.chat, body))
            continue
        parsed = json.loads(body)
        schema.model_validate(parsed)
        chars = sum(len(m["content"]) for m in parsed["messages"]) if plan.chat else len(parsed["prompt"])
        if plan.kind == "huge":
            assert chars > 512 or len(parsed["prompt"]) > 512  # token ids for completions
            continue
        # a byte-level tokenizer gives at most one token per character: prompt + output + a chat template fit
        assert chars + 16 + 64 <= 512
        assert parsed["model"] == ("base" if plan.adapter is None else f"a{plan.adapter}")
        assert parsed["n"] == plan.n and parsed["stream"] == plan.stream
        if plan.prefix is not None:
            assert target.prefixes[plan.prefix] in json.dumps(parsed)
        assert ("response_format" in parsed) == (plan.structured == "json_schema")
        assert ("tools" in parsed and "tool_choice" in parsed) == (plan.structured == "tools")
    assert len(malformed) == 12  # every case of both endpoints was drawn


STREAM = Planned(0, "valid", chat=True, stream=True, n=2)
PLAIN = Planned(1, "valid", chat=False, n=1)


def outcome(plan: Planned, **seen) -> Outcome:
    return Outcome(plan, **{"status": 200, "done_s": 1.0, **seen})


@pytest.mark.parametrize(
    "seen, category",
    [
        ({"finishes": Counter({0: 1, 1: 1}), "done_events": 1}, "answered"),
        ({"finishes": Counter({0: 1}), "done_events": 1}, "failed"),  # a choice never finished
        ({"finishes": Counter({0: 2, 1: 1}), "done_events": 1}, "failed"),  # one finished twice
        ({"finishes": Counter({0: 1, 1: 1}), "done_events": 0}, "failed"),  # no [DONE]
        ({"finishes": Counter({0: 1, 1: 1}), "done_events": 2}, "failed"),  # two
        ({"finishes": Counter({0: 1, 1: 1}), "done_events": 1, "events_after_done": 1}, "failed"),
        ({"finishes": Counter({0: 1, 1: 1}), "done_events": 1, "error": "boom"}, "failed"),
        ({"dropped": True}, "dropped"),
        ({"status": 503, "retry_after": True}, "rejected"),
        ({"status": 503}, "failed"),  # an overload answer must say when to retry
        ({"status": 500, "error": "x"}, "failed"),
        ({"status": None, "error": "still open"}, "failed"),
        ({"status": 400}, "failed"),  # a valid request refused
    ],
)
def test_judge_a_stream(seen, category):
    assert soak.judge(outcome(STREAM, **seen))[0] == category


@pytest.mark.parametrize(
    "plan, seen, category",
    [
        (PLAIN, {"answers": 1, "choices": 1}, "answered"),
        (PLAIN, {"answers": 1, "choices": 0}, "failed"),  # no finish_reason
        (PLAIN, {"answers": 0}, "failed"),
        (Planned(2, "malformed", chat=True), {"status": 400}, "refused"),
        (Planned(2, "malformed", chat=True), {"status": 422}, "failed"),
        (Planned(2, "malformed", chat=True), {"status": 500}, "failed"),
        (Planned(3, "huge", chat=False), {"status": 400}, "refused"),
        (Planned(3, "huge", chat=False), {"status": 200, "answers": 1, "choices": 1}, "failed"),
        (Planned(3, "huge", chat=False), {"status": 503, "retry_after": True}, "failed"),  # never runnable
    ],
)
def test_judge_the_rest(plan, seen, category):
    assert soak.judge(outcome(plan, **seen))[0] == category


def test_tally_and_the_cross_check_with_the_servers_counts():
    outcomes = [
        outcome(STREAM, finishes=Counter({0: 1, 1: 1}), done_events=1),
        outcome(PLAIN, answers=1, choices=1),
        outcome(STREAM, dropped=True),
        outcome(STREAM, dropped=True),
        outcome(PLAIN, status=503, retry_after=True),
        outcome(Planned(2, "malformed", chat=False), status=400),
        outcome(PLAIN, status=502),
    ]
    client = soak.tally(outcomes)
    assert client["counts"] == {"answered": 2, "dropped": 2, "rejected": 1, "refused": 1, "failed": 1}
    assert client["accepted"] == 4 and client["server_errors"] == 1 and len(client["problems"]) == 1
    assert client["rejected_by_kind"] == {"completions": 1} and client["refused_by_kind"] == {"malformed": 1}
    assert soak.cross_check(client, {"length": 1, "stop": 1, "abort": 2}) is None
    assert soak.cross_check(client, {"length": 2, "stop": 1, "abort": 1}) is None  # one ended before the drop
    assert "finished 5" in soak.cross_check(client, {"length": 2, "stop": 1, "abort": 2})  # one twice
    assert "finished 3" in soak.cross_check(client, {"length": 1, "abort": 2})  # one never finished
    assert "aborted 3" in soak.cross_check(client, {"length": 1, "abort": 3})
    assert "failed 1" in soak.cross_check(client, {"length": 1, "stop": 1, "abort": 1, "error": 1})


def test_a_sample_counts_everything_so_far_and_rates_over_its_window():
    progress = soak.Progress()
    answered = [
        outcome(PLAIN, answers=1, choices=1, done_s=t, output_tokens=10, sent_s=t - 1, first_s=t - 0.5)
        for t in (1.0, 4.0, 6.0, 9.5)
    ]
    for o in [*answered[:3], outcome(PLAIN, status=503, retry_after=True, done_s=7.0), answered[3]]:
        progress.sent += 1
        progress.end(o)
    progress.sent += 1  # one still open
    row = soak.sample_row(10.0, "load", {"pagellm:num_requests_running": 2.0}, 900.0, progress, window=5.0)
    assert (row["sent"], row["completed"], row["rejected"], row["failed"]) == (6, 4, 1, 0)
    assert row["completed_per_s"] == 2 / 5 and row["output_tok_s"] == 20 / 5  # those done at 6.0 and 9.5
    assert row["ttft_p50_ms"] == pytest.approx(500) and row["running"] == 2 and row["waiting"] is None
    assert set(row) | {"metrics_ms"} == set(soak.CSV_COLUMNS)


def test_memory_check():
    assert soak.memory_check(1000.0, 1049.0)[0] is True
    assert soak.memory_check(1000.0, 1051.0)[0] is False
    assert soak.memory_check(1000.0, 700.0)[0] is True  # less is no leak
    assert soak.memory_check(None, 700.0) == (None, "not measured")


def test_parse_metrics_sums_by_name_and_labels_but_the_model():
    text = """# HELP pagellm:num_requests_running Requests.
pagellm:num_requests_running{model_name="m"} 3.0
pagellm:request_success_total{finished_reason="stop",model_name="m"} 5.0
pagellm:request_success_total{finished_reason="abort",model_name="m"} 2.0
pagellm:kv_cache_usage_perc{model_name="m"} 0.25
"""
    values = soak.parse_metrics(text)
    assert values["pagellm:num_requests_running"] == 3 and values["pagellm:kv_cache_usage_perc"] == 0.25
    assert soak.finished_by_reason(values) == {"stop": 5, "abort": 2}


@pytest.mark.slow
def test_a_short_soak_on_a_tiny_model_passes_every_check(tiny_model, tmp_path):
    """About a minute: 40 s of load at 8 requests/s (more than two shared cores serve), the drain; every
    check must pass, with some of each kind of traffic seen (drops, 400s, LoRA and grammar requests in
    flight). A fixed rate, not calibration, so the counts do not depend on how busy the machine is."""
    args = soak.SoakArgs(
        model=tiny_model,
        engine={"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256},
        duration=40,
        request_rate=8,
        output_len_min=16,  # long enough, and sampled often enough, that LoRA and grammar requests are
        output_len_max=48,  # caught in flight: at 4-16 tokens a 3 s sample saw one ~5% of the time
        sample_interval=1,
        csv_path=str(tmp_path / "soak.csv"),
        output_json=str(tmp_path / "soak.json"),
    )
    sections = soak.main(args)  # raises SoakFailed when a check fails
    assert all(c["passed"] for c in sections["checks"]), sections["checks"]
    counts = sections["results"]["counts"]
    assert counts["answered"] > 100 and counts["dropped"] > 0 and counts["refused"] > 0
    samples = sections["samples"]
    assert max(s["lora_requests_running"] for s in samples) > 0
    assert max(s["grammar_matchers_live"] for s in samples) > 0
    header = (tmp_path / "soak.csv").read_text().splitlines()[0]
    assert header.startswith("time_s,phase,rss_mib,running,waiting,kv_usage")
    assert json.loads((tmp_path / "soak.json").read_text())["command"] == "soak"


def test_the_drain_waits_while_requests_end_and_gives_up_on_a_stall():
    """A server over its capacity holds hundreds of requests when the load stops: draining takes minutes,
    which a fixed timeout cut short (the first 30-minute run on model S counted them as unanswered)."""

    async def run():
        ending = [asyncio.create_task(asyncio.sleep(0.06 * i)) for i in range(1, 6)]  # one every 0.06 s
        stuck = asyncio.create_task(asyncio.sleep(60))
        open_tasks = await soak.drain([*ending, stuck], stall_s=0.15)
        stuck.cancel()
        return open_tasks, stuck, ending

    open_tasks, stuck, ending = asyncio.run(run())
    assert open_tasks == {stuck} and all(task.done() for task in ending)
