"""What a hostile client tried (issue 9), against the app in-process: one request's bad parameters answer 400
(or fail that request alone) and never fail its neighbours; bodies and costs are bounded; tokenizing a huge
prompt leaves the event loop free; 500s carry an id, not the exception; the OpenAPI schema tells the truth.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import jsonschema
import pytest

from pagellm import AsyncLLM, SamplingParams
from pagellm.engine.async_llm import EngineError
from pagellm.server.app import build_app

PROMPTS = ["Hello, world!", "The quick brown fox", "Paged attention", "Once upon a time"]
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False)


def call(app, *requests: tuple[str, str, object]) -> list[httpx.Response]:
    """Send (method, path, body) requests to the app concurrently; a str body goes as raw JSON text."""

    async def one(client: httpx.AsyncClient, method: str, path: str, body: object) -> httpx.Response:
        if isinstance(body, str):
            headers = {"content-type": "application/json"}
            return await client.request(method, path, content=body, headers=headers)
        return await client.request(method, path, json=body)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=60) as client:
            return await asyncio.gather(*(one(client, *r) for r in requests))

    return asyncio.run(run())


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


# -- 1. one request's parameters never fail its neighbours -----------------------------------------------------


def test_a_seed_out_of_range_is_refused_and_its_neighbours_run(app):
    neighbours = [("POST", "/v1/completions", {"prompt": p, **GREEDY}) for p in PROMPTS[:3]]
    neighbours.append(("POST", "/v1/completions", {"prompt": PROMPTS[3], "stream": True, **GREEDY}))
    seeds = [2**70, 2**64, -(2**63) - 1]
    bad = [("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": s}) for s in seeds]
    *refused, a, b, c, streamed = call(app, *bad, *neighbours)
    for response in refused:
        assert error(response)["param"] == "seed"
    for response in (a, b, c):
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert (
        streamed.status_code == 200
        and '"error"' not in streamed.text
        and streamed.text.endswith("[DONE]\n\n")
    )
    # the last seeds of the range still give every sample of n > 1 a seed of its own
    (edge,) = call(
        app, ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "seed": 2**64 - 1})
    )
    assert edge.status_code == 200 and len(edge.json()["choices"]) == 2
    with pytest.raises(ValueError, match="^seed must be in"):  # LLM() refuses it as clearly
        SamplingParams(seed=2**64)


def test_a_request_the_model_runner_fails_on_fails_alone(llm: AsyncLLM, monkeypatch):
    poison = llm.tokenizer.encode("poison", add_special_tokens=False)
    runner = llm.engine.runner
    real_execute = runner.execute

    def execute(out):
        if any(r.prompt_token_ids == poison for r in out.scheduled):
            raise RuntimeError("injected failure on the poisoned request")
        return real_execute(out)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta")

    async def text(stream, first: str = "") -> str:
        return first + "".join([o.outputs[0].text async for o in stream])

    async def run() -> tuple[list[str], list[str]]:
        alone = [await text(await llm.add_request(p, params)) for p in PROMPTS]
        monkeypatch.setattr(runner, "execute", execute)
        streams = [await llm.add_request(p, params) for p in PROMPTS]
        firsts = [(await s.__anext__()).outputs[0].text for s in streams]  # all four are running now
        with pytest.raises(EngineError) as failed:
            await text(await llm.add_request({"prompt_token_ids": poison}, params, request_id="poisoned"))
        assert "request poisoned failed" in str(failed.value) and "injected" not in str(failed.value)
        together = [await text(s, f) for s, f in zip(streams, firsts, strict=True)]
        return alone, together

    alone, together = asyncio.run(run())
    assert together == alone


# -- 2. body size and the event loop ------------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413_whether_its_length_is_declared_or_not(llm):
    small = build_app(llm, ["tiny"], log_requests=False, max_body_bytes=1000)
    body = json.dumps({"prompt": "x" * 2000, "max_tokens": 1})

    async def chunked():
        for start in range(0, len(body), 500):
            yield body[start : start + 500].encode()

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=small)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            headers = {"content-type": "application/json"}
            declared = await client.post("/v1/completions", content=body, headers=headers)
            streamed = await client.post("/tokenize", content=chunked(), headers=headers)
            fine = await client.post("/tokenize", json={"prompt": "x" * 500})
            return [declared, streamed, fine]

    declared, streamed, fine = asyncio.run(run())
    for response in (declared, streamed):
        assert "1000 bytes" in error(response, 413)["message"]
    assert fine.status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(app):
    prompt = "the quick brown fox jumps over the lazy dog " * (2 * 2**20 // 44)  # 2 MiB: seconds to tokenize

    async def run() -> tuple[httpx.Response, list[float]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
            huge = asyncio.create_task(
                client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            )
            waits = []
            while not huge.done():
                started = time.monotonic()
                response = await asyncio.wait_for(client.get("/health"), timeout=5)
                assert response.status_code == 200
                waits.append(time.monotonic() - started)
                await asyncio.sleep(0.1)
            return await huge, waits

    huge, waits = asyncio.run(run())
    assert error(huge)["param"] == "prompt"  # far longer than the context, refused after tokenizing
    assert len(waits) >= 3 and max(waits) < 0.5, waits


# -- 3-5. invalid values answer 400, naming the field -----------------------------------------------------------


def test_invalid_values_answer_400_naming_the_field(app):
    chat = "/v1/chat/completions"
    cases = [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "a\\udc00"], "max_tokens": 2}', "prompt"),
        ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
        (chat, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "temperature": 1e999}', "temperature"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "temperature": Infinity}', "temperature"),
        (
            "/v1/completions",
            '{"prompt": "x", "max_tokens": 2, "repetition_penalty": 1e999}',
            "repetition_penalty",
        ),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "top_k": 1e30}', "top_k"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "top_k": 100000000000000000000}', "top_k"),
        (chat, '{"messages": [{"role": "wizard", "content": "Hi"}]}', "messages"),
        (chat, '{"messages": [{"role": "user", "content": null}]}', "messages"),
        ("/detokenize", '{"tokens": [false]}', "tokens"),
        ("/v1/completions", '{"prompt": [true, 2], "max_tokens": 2}', "prompt"),
    ]
    responses = call(app, *(("POST", path, body) for path, body, _ in cases))
    for (path, body, param), response in zip(cases, responses, strict=True):
        assert error(response)["param"] == param, (path, body)


def test_n_is_bounded_and_so_is_what_one_request_may_hold_of_the_kv_cache(app, llm):
    capacity = llm.kv_cache_tokens  # 2032 tokens: 127 usable blocks of 16; the context is 128
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    over_n, costly, costly_chat, many_prompts, fine = call(
        app,
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 129}),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 100, "n": 32}),  # 32 x (prompt + 100)
        ("POST", "/v1/chat/completions", {**chat, "n": 16}),  # no max_tokens: 16 x 128, the context
        ("POST", "/v1/completions", {"prompt": ["x"] * 30, "max_tokens": 100}),  # 30 x (prompt + 100)
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10, "n": 16}),
    )
    assert "<= 128" in error(over_n)["message"] and error(over_n)["param"] == "n"
    for response in (costly, costly_chat):
        assert str(capacity) in error(response)["message"] and error(response)["param"] == "n"
    assert error(many_prompts)["param"] == "prompt"
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 16
    (over_flag,) = call(
        build_app(llm, ["tiny"], log_requests=False, max_n=4),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 5}),
    )
    assert "<= 4" in error(over_flag)["message"]


# -- 7. 500s: an id, never the exception ------------------------------------------------------------------------


def test_a_500_carries_an_id_for_the_log_not_the_exception(app, llm, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(llm.tokenizer, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="pagellm"):
        (response,) = call(app, ("POST", "/tokenize", {"prompt": "Hi"}))
    body = error(response, 500)
    assert body["type"] == "server_error" and "secret" not in body["message"]
    error_id = next(word for word in body["message"].split() if word.startswith("error-")).rstrip(".")
    record = next(r for r in caplog.records if error_id in r.getMessage())
    assert "secret internal detail" in repr(record.exc_info[1])


# -- 6. the OpenAPI schema says what the server does ------------------------------------------------------------


def test_the_openapi_schema_documents_what_the_server_answers(app):
    (schema,) = call(app, ("GET", "/openapi.json", None))
    paths = schema.json()["paths"]
    for path, operations in paths.items():
        name = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        name = "OllamaErrorResponse" if path.startswith("/api/") else name
        error_body = {"$ref": f"#/components/schemas/{name}"}
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if method == "post":
                assert responses["400"]["content"]["application/json"]["schema"] == error_body
                assert responses["413"]["content"]["application/json"]["schema"] == error_body
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    streams = paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streams) == {"application/json", "text/event-stream"}
    wrong_method, health = call(app, ("PUT", "/health", None), ("GET", "/health", None))
    assert error(wrong_method, 405) and wrong_method.headers["allow"] == "GET"
    assert health.status_code == 200 and health.content == b""


def server_sent_events(text: str) -> list[dict[str, str]]:
    """A stream's events parsed into their fields, as an SSE client (and schemathesis) reads them."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(":")
            fields[name] = fields[name] + "\n" + value.strip() if name in fields else value.strip()
        if fields:
            events.append(fields)
    return events


def test_each_streamed_event_keeps_to_the_documented_schema(app):
    """Found by schemathesis (ST108): the stream was documented as one string, each parsed event broke it."""
    (schema,) = call(app, ("GET", "/openapi.json", None))
    paths = schema.json()["paths"]
    streamed = {
        "/v1/completions": {"prompt": "Hello", "stream": True, **GREEDY},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "stream": True, **GREEDY},
        "/v1/messages": {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "stream": True,
        },
    }
    responses = call(app, *(("POST", path, body) for path, body in streamed.items()))
    for path, response in zip(streamed, responses, strict=True):
        assert response.status_code == 200, response.text
        event_schema = paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        events = server_sent_events(response.text)
        assert len(events) > 2
        for event in events:
            jsonschema.validate(event, event_schema)
