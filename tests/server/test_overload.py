"""Bounded overload (--max-waiting-requests): past the bound a request is refused at once with 503, Retry-After
and an OpenAI-style body (Anthropic's under /v1/messages), counted in /metrics; the accepted ones all finish;
/health and /metrics keep answering quickly under the flood."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pagellm import AsyncLLM
from pagellm.server.app import build_app


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    llm = AsyncLLM(
        str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=128,
        max_num_seqs=1,  # one runs, the rest wait
        max_waiting_requests=2,
        engine_process=False,
    )
    yield build_app(llm, ["tiny"], log_requests=False)
    llm.shutdown()


def test_a_flood_gets_503s_past_the_bound_and_health_stays_quick(app):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as http:
            flood = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(12)]
            probes = []
            for _ in range(5):
                for path in ("/health", "/metrics"):
                    began = time.perf_counter()
                    response = await http.get(path)
                    probes.append((path, response.status_code, time.perf_counter() - began))
                await asyncio.sleep(0.02)
            answers = await asyncio.gather(*flood)
            metrics = (await http.get("/metrics")).text
            return answers, probes, metrics

    answers, probes, metrics = asyncio.run(run())
    refused = [r for r in answers if r.status_code == 503]
    served = [r for r in answers if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 12
    assert len(served) <= 1 + 2 + 1  # the running one, the bound, and one accepted as another started
    for response in refused:
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "overloaded_error" and "--max-waiting-requests 2" in error["message"]
    for response in served:
        assert len(response.json()["choices"][0]["text"]) > 0
    assert all(status == 200 and seconds < 0.1 for _, status, seconds in probes), probes
    rejected = next(
        line for line in metrics.splitlines() if line.startswith("pagellm:requests_rejected_total")
    )
    assert float(rejected.split()[-1]) >= len(refused)


def test_a_request_that_can_never_run_gets_400_even_when_the_queue_is_full(app):
    """The soak's huge prompts got 503 and Retry-After under overload (the queue bound was checked before
    the engine measured the prompt), so a client that obeys Retry-After would retry them forever."""
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 100, "ignore_eos": True}
    too_long = [
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 200, "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 100, "max_tokens": 40}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 200}]},
            "messages",
        ),
    ]

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as http:
            flood = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(8)]
            await asyncio.sleep(0.05)  # the queue is full now (one runs 100 tokens, two wait)
            refused = await asyncio.gather(*(http.post(path, json=b) for path, b, _ in too_long))
            statuses = [r.status_code for r in await asyncio.gather(*flood)]
            return refused, statuses

    refused, statuses = asyncio.run(run())
    assert 503 in statuses  # the queue was full while they came
    for response, (_, _, param) in zip(refused, too_long, strict=True):
        assert response.status_code == 400, response.text
        assert (
            response.json()["error"]["param"] == param
            and "max_model_len" in response.json()["error"]["message"]
        )


def test_anthropic_clients_get_their_overloaded_error():
    import json

    from pagellm.engine.async_llm import OverloadedError
    from pagellm.server.errors import error_response, from_exception

    response = error_response(from_exception(OverloadedError("full", retry_after_s=1)), path="/v1/messages")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "full"},
    }


def test_a_request_past_request_timeout_is_aborted_its_blocks_freed_and_answered_408(tiny_model_dir):
    llm = AsyncLLM(
        str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=128,
        max_model_len=512,
        request_timeout=0.25,
        engine_process=False,
    )
    app = build_app(llm, ["tiny"], log_requests=False)
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    short = {**long, "max_tokens": 2}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=60) as http:
            began = time.perf_counter()
            slow = await http.post("/v1/completions", json=long)
            waited = time.perf_counter() - began
            streamed = await http.post("/v1/completions", json={**long, "stream": True})
            quick = await http.post("/v1/completions", json=short)
            await asyncio.sleep(0.2)  # the engine's next turn reports the aborts
            return slow, waited, streamed, quick

    try:
        slow, waited, streamed, quick = asyncio.run(run())
        assert slow.status_code == 408 and slow.json()["error"]["type"] == "timeout_error"
        assert "--request-timeout" in slow.json()["error"]["message"] and waited < 5
        assert (
            streamed.status_code == 200 and "--request-timeout" in streamed.text
        )  # an error event, then [DONE]
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert quick.status_code == 200  # a request within the time is untouched
        stats = llm.latest_stats
        assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_killed_engine_fails_in_flight_requests_and_the_server_exits_non_zero(tiny_model_dir, tmp_path):
    """What a supervisor needs: the in-flight request gets a clear error, then `pagellm serve` exits non-zero."""
    import os
    import signal

    from server_harness import ServerProcess

    server = ServerProcess(tiny_model_dir, ["--dtype", "float32", "--num-kv-blocks", "64"], tmp_path / "log")
    try:
        children = [
            int(pid)
            for pid in os.listdir("/proc")
            if pid.isdigit() and _parent(int(pid)) == server.process.pid
        ]
        body = {
            "model": str(tiny_model_dir),
            "prompt": "Hi",
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert "engine process exited" in rest and rest.rstrip().endswith("data: [DONE]")
        assert server.process.wait(timeout=30) != 0
        assert "the server stopped" in server.log_path.read_text()
    finally:
        server.stop()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_the_lora_and_grammar_gauges_follow_the_engines_stats():
    """pagellm:lora_requests_running, lora_adapters_active and grammar_matchers_live: what `bench soak`
    checks for 0 after its drain."""
    from pagellm.engine.core import IterationStats
    from pagellm.engine.scheduler import SchedulerStats
    from pagellm.server.metrics import PrometheusStatLogger

    def gauges(stats: SchedulerStats) -> dict[str, float]:
        logger = PrometheusStatLogger("tiny")
        logger.record(stats, IterationStats())
        text = logger.exposition().decode()
        names = ("lora_requests_running", "lora_adapters_active", "grammar_matchers_live")
        return {
            name: float(line.rsplit(" ", 1)[1])
            for name in names
            for line in text.splitlines()
            if line.startswith(f'pagellm:{name}{{model_name="tiny"}}')
        }

    busy = SchedulerStats(3, 0, 0.5, 0, 0, 0, num_lora_requests_running=3, num_loras_active=2)
    busy.num_grammar_matchers_live = 4
    assert gauges(busy) == {"lora_requests_running": 3, "lora_adapters_active": 2, "grammar_matchers_live": 4}
    idle = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    assert gauges(idle) == {"lora_requests_running": 0, "lora_adapters_active": 0, "grammar_matchers_live": 0}
