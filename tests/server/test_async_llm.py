"""AsyncLLM in-process: concurrent streams share steps and match the offline LLM; aborts (before the first
token, mid-stream, by cancelling) free KV blocks; a failing step fails its requests, not the engine; and the
app answers 500 for them and keeps serving."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from pagellm import LLM, AsyncLLM, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.engine.async_llm import EngineError
from pagellm.engine.processor import PromptTooLongError
from pagellm.server.app import build_app

PROMPTS = ["Hello, world!", "The quick brown fox", "Paged attention", "Once upon a time", "1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=128)


def assert_idle(llm: AsyncLLM) -> None:
    """No request left in the engine and every KV block free (checked on the engine thread's side)."""
    stats = llm.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)


async def wait_idle(llm: AsyncLLM) -> None:
    for _ in range(200):
        stats = llm.engine.stats()
        if (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0):
            return
        await asyncio.sleep(0.01)
    assert_idle(llm)


def test_concurrent_generate_matches_offline_in_both_output_kinds(llm, offline):
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, GREEDY, use_tqdm=False)]
    steps = []
    real_step = llm.engine.step

    def counting_step():
        outputs = real_step()
        steps.append(len(outputs))
        return outputs

    async def collect(prompt: str, kind: str) -> str:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind)
        outputs = [o async for o in llm.generate(prompt, params)]
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        if kind == "delta":
            return "".join(o.outputs[0].text for o in outputs)
        return outputs[-1].outputs[0].text

    async def run():
        return await asyncio.gather(*(collect(p, k) for k in ("delta", "cumulative") for p in PROMPTS))

    llm.engine.step = counting_step
    try:
        assert asyncio.run(run()) == expected * 2
    finally:
        del llm.engine.step
    assert max(steps) > 1  # concurrent requests shared engine steps
    assert_idle(llm)


def test_invalid_input_raises_at_add(llm):
    async def run():
        with pytest.raises(PromptTooLongError, match="128"):
            await llm.add_request("hello " * 200, GREEDY)
        with pytest.raises(ConfigError, match="empty"):
            await llm.add_request({"prompt_token_ids": []}, GREEDY)
        # long enough to be still running at the second add (8 tokens may end before it)
        stream = await llm.add_request("Hello", LONG, request_id="same")
        with pytest.raises(ConfigError, match="same"):
            await llm.add_request("Hello", GREEDY, request_id="same")
        stream.abort()
        await wait_idle(llm)

    asyncio.run(run())
    assert_idle(llm)


def test_one_request_id_used_again_and_again(llm):
    """A caller that labels requests by session reuses an id as soon as its stream ended, before the
    engine's next step has told the runner that the previous request finished."""

    async def run():
        for _ in range(40):
            outputs = [o async for o in llm.generate("Hello", GREEDY, request_id="session")]
            assert outputs[-1].finished and outputs[-1].request_id == "session"
            assert len(outputs[-1].outputs[0].token_ids) == 8

    asyncio.run(run())
    assert_idle(llm)


def test_abort_before_first_token_mid_stream_and_by_cancelling(llm):
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind="delta")

    async def run():
        # the abort reaches the engine thread in the same turn as the add: no token is ever made
        stream = await llm.add_request("Hello", long)
        stream.abort()
        llm.abort(stream.request_id)  # twice is harmless
        await wait_idle(llm)

        stream = await llm.add_request("Hello", long)
        first = await stream.__anext__()
        assert first.outputs[0].token_ids and not first.finished
        stream.abort()
        await wait_idle(llm)

        async def consume():
            async for _ in llm.generate("Hello", long):
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(llm)

    asyncio.run(run())


def test_failing_step_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    real_step = llm.engine.step
    failures = iter([True])

    def flaky_step():
        if next(failures, False):
            raise RuntimeError("injected kernel failure")
        return real_step()

    async def run():
        monkeypatch.setattr(llm.engine, "step", flaky_step)
        with pytest.raises(EngineError, match="request failing-step failed"):
            [o async for o in llm.generate("Hello", GREEDY, request_id="failing-step")]
        await wait_idle(llm)
        outputs = [o async for o in llm.generate("Hello", GREEDY)]
        assert outputs[-1].outputs[0].finish_reason == "length"

    asyncio.run(run())
    assert llm.is_running


def test_app_answers_500_for_a_failed_step_and_keeps_serving(llm, monkeypatch):
    app = build_app(llm, ["tiny"], log_requests=False)
    real_step = llm.engine.step
    failures = iter([True, True])

    def flaky_step():
        if next(failures, False):
            raise RuntimeError("injected kernel failure")
        return real_step()

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
            monkeypatch.setattr(llm.engine, "step", flaky_step)
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error" and "injected" not in error["message"]
            assert re.search(r"request cmpl-\w+ failed", error["message"])  # the id to find it in the log
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200 and '"server_error"' in streamed.text
            assert streamed.text.endswith("data: [DONE]\n\n")
            ok = await client.post("/v1/completions", json=body)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            metrics = (await client.get("/metrics")).text
            assert 'pagellm:request_success_total{finished_reason="error",model_name="tiny"} 2.0' in metrics

    asyncio.run(run())
    assert_idle(llm)


def test_app_aborts_when_the_client_disconnects_before_its_first_token(llm):
    """Raw ASGI calls whose client hangs up right after sending the body, with and without streaming, and
    under both disconnect protocols (ASGI spec 2.3: the server watches; 2.4: a failed send tells)."""
    app = build_app(llm, ["tiny"], log_requests=False)

    async def call(body: dict, spec: str) -> None:
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive() -> dict:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            pass

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": spec},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)
        await wait_idle(llm)

    async def aborted() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return (await client.get("/metrics")).text.count('finished_reason="abort",model_name="tiny"} 4.0')

    async def run():
        for spec in ("2.3", "2.4"):
            for stream in (False, True):
                body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": stream}
                await call(body, spec)
        assert await aborted() == 1

    asyncio.run(run())


def test_app_chat_template_flag_and_request_field(llm):
    app = build_app(llm, ["tiny"], chat_template="{{ messages[0]['content'] }}!", log_requests=False)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            messages = [{"role": "user", "content": "Hi"}]
            tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
            assert tokens == llm.tokenizer.encode("Hi!")
            body = {"messages": messages, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }}?"}
            response = (await client.post("/v1/chat/completions", json=body)).json()
            assert response["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("Hi?"))
            broken = await client.post("/v1/chat/completions", json={**body, "chat_template": "{{ nope( }}"})
            assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"

    asyncio.run(run())


def test_shutdown_fails_running_requests_and_health_says_so(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)
    app = build_app(llm, ["tiny"])

    async def run():
        stream = await llm.add_request("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
        llm.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            [o async for o in stream]
        with pytest.raises(EngineError, match="shut down"):
            await llm.add_request("Hello")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            assert (await client.get("/health")).status_code == 503

    asyncio.run(run())
    assert not llm.is_running
