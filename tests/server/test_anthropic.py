"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` client,
in-process: a message is the chat endpoint's reply in Anthropic's shape, its event stream builds the same
message, stop sequences and tool calls map to Anthropic's stop reasons and blocks (a tool round trip works),
and errors take Anthropic's body and statuses, x-api-key included.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import jsonschema
import pytest

from pagellm.server.app import build_app

GREEDY = {"temperature": 0}  # this client has no sampling arguments: they go in extra_body
TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ONE = {"type": "any", "disable_parallel_tool_use": True}  # one call (any number: until max_tokens)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False)


def call(app, work, api_key: str = "none", headers: dict | None = None):
    """Run `await work(client, http)`: an AsyncAnthropic client and an httpx2 client bound to `app`."""

    async def run():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://app", headers=headers) as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://app", api_key=api_key, http_client=http, max_retries=0
            )
            return await work(client, http)

    return asyncio.run(run())


def blocks(message) -> list[dict]:
    """A message's content blocks as plain dicts (a streamed message's are the client's Parsed* classes)."""
    return [{k: v for k, v in b.to_dict().items() if k != "parsed_output"} for b in message.content]


def events(response) -> list[tuple[str, dict]]:
    """(event name, data) of a server-sent event stream; the name must be the data's type."""
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


def test_a_message_is_the_chat_reply_in_anthropic_shape(app):
    system = [{"type": "text", "text": "Be terse."}]
    blocks = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    kwargs = dict(model="tiny", max_tokens=12, system=system, messages=[{"role": "user", "content": blocks}])
    chat_body = {
        "model": "tiny",
        "max_tokens": 12,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello\nthere"}],
        **GREEDY,
    }

    async def work(client, http):
        message = await client.messages.create(**kwargs, extra_body=GREEDY)
        counted = await client.messages.count_tokens(model="tiny", system=system, messages=kwargs["messages"])
        chat = (await http.post("/v1/chat/completions", json=chat_body)).json()
        return message, counted, chat

    message, counted, chat = call(app, work)
    choice = chat["choices"][0]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"
    assert [(b.type, b.text) for b in message.content] == [("text", choice["message"]["content"])]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert message.stop_sequence is None
    assert message.usage.input_tokens == counted.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_the_event_stream_builds_the_same_message(app):
    kwargs = dict(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "Count to five."}])

    async def work(client, http):
        whole = await client.messages.create(**kwargs, extra_body={**GREEDY, "ignore_eos": True})
        async with client.messages.stream(**kwargs, extra_body={**GREEDY, "ignore_eos": True}) as stream:
            final = await stream.get_final_message()
        raw = await http.post("/v1/messages", json={**kwargs, **GREEDY, "ignore_eos": True, "stream": True})
        return whole, final, raw

    whole, final, raw = call(app, work)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    sequence = events(raw)
    names = [name for name, _ in sequence]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = sequence[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert sequence[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data["delta"] for _, data in sequence[2:-3]]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    delta = sequence[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": 10}


def test_a_stop_sequence_ends_the_message_and_is_named(app):
    kwargs = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "Hello"}])

    async def free(client, http):
        return await client.messages.create(**kwargs, extra_body={**GREEDY, "ignore_eos": True})

    text = call(app, free).content[0].text
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.isalnum())
    stop = text[at]

    async def stopped(client, http):
        whole = await client.messages.create(**kwargs, stop_sequences=[stop], extra_body=GREEDY)
        async with client.messages.stream(**kwargs, stop_sequences=[stop], extra_body=GREEDY) as stream:
            streamed = await stream.get_final_message()
        return whole, streamed

    for message in call(app, stopped):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert message.content[0].text == text[: text.index(stop)]


def test_a_tool_round_trip(app):
    """tool_choice any and a named tool give tool_use blocks whose input validates, streamed or not; the
    tool_use block and a tool_result block come back in the conversation."""

    async def work(client, http):
        common = dict(model="tiny", max_tokens=80, messages=ASK, tools=[TOOL], extra_body=GREEDY)
        anyone = await client.messages.create(**common, tool_choice=ONE)
        named = await client.messages.create(**common, tool_choice={"type": "tool", "name": "get_weather"})
        async with client.messages.stream(**common, tool_choice=ONE) as stream:
            streamed = await stream.get_final_message()
        raw = await http.post(
            "/v1/messages",
            json={**common["extra_body"], **{k: v for k, v in common.items() if k != "extra_body"}, "stream": True,
                  "tool_choice": ONE},
        )  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": anyone.content[0].id, "content": "sunny"}
        turns = [
            *ASK,
            {"role": "assistant", "content": anyone.content},
            {"role": "user", "content": [result]},
        ]
        answer = await client.messages.create(model="tiny", max_tokens=8, messages=turns, tools=[TOOL],
                                              tool_choice={"type": "none"})  # fmt: skip
        counted = await client.messages.count_tokens(model="tiny", messages=turns, tools=[TOOL])
        openai_turns = [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(anyone.content[0].input)}}]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ]  # fmt: skip
        tokens = (await http.post("/tokenize", json={"messages": openai_turns})).json()
        return anyone, named, streamed, raw, answer, counted, tokens

    anyone, named, streamed, raw, answer, counted, tokens = call(app, work)
    for message in (anyone, named, streamed):
        assert message.stop_reason == "tool_use", message
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
        jsonschema.validate(block.input, TOOL["input_schema"])
    assert blocks(streamed) == [{**blocks(anyone)[0], "id": streamed.content[0].id}]
    sequence = events(raw)
    assert sequence[1][1]["content_block"] == {
        "type": "tool_use",
        "id": sequence[1][1]["content_block"]["id"],
        "name": "get_weather",
        "input": {},
    }
    partial = [d["delta"]["partial_json"] for n, d in sequence if n == "content_block_delta"]
    assert partial and json.loads("".join(partial)) == anyone.content[0].input
    assert sequence[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert counted.input_tokens == tokens["count"]  # the same turns as OpenAI's tool_calls and tool turns


def test_errors_take_anthropic_shape_and_status(app):
    good = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    bad = [
        ({k: v for k, v in good.items() if k != "max_tokens"}, 400, "max_tokens"),
        ({**good, "max_tokens": 0}, 400, "max_tokens"),
        ({**good, "temperature": -1}, 400, "temperature"),
        ({**good, "stop_sequences": [""]}, 400, "stop_sequences"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                             "input": {}}]}]}, 400, "messages.0.content.0"),
        ({**good, "max_tokens": 10_000}, 400, "max_tokens"),
        ({**good, "tools": [TOOL]}, 400, "tool_choice"),  # auto needs the server's flags
        ({**good, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "nope"),
        ({**good, "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
        ({**good, "model": "claude-nope"}, 404, "claude-nope"),
    ]  # fmt: skip

    async def work(client, http):
        replies = await asyncio.gather(
            *(http.post("/v1/messages", json=body) for body, _, _ in bad),
            http.post("/v1/messages", json=good),  # its neighbours' errors do not touch it
            http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": []}),
            http.post("/v1/messages/nothing", json=good),
        )
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="tiny", max_tokens=-1, messages=ASK)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
        return replies, refused.value

    replies, refused = call(app, work)
    types = {400: "invalid_request_error", 404: "not_found_error"}
    for (body, status, named), reply in zip(bad, replies, strict=False):
        assert reply.status_code == status, (body, reply.text)
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == types[status]
        assert named in reply.json()["error"]["message"], reply.text
    ok, empty, nowhere = replies[len(bad) :]
    assert ok.status_code == 200 and ok.json()["content"][0]["type"] == "text"
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"
    assert refused.status_code == 400 and "max_tokens" in refused.message


def test_api_keys_in_x_api_key_or_bearer(llm):
    keyed = build_app(llm, ["tiny"], log_requests=False, api_keys=["sk-a"])
    body = {"model": "tiny", "max_tokens": 2, "messages": ASK}

    async def work(client, http):
        plain = await http.post("/v1/messages", json=body)
        header = await http.post("/v1/messages", json=body, headers={"x-api-key": "sk-a"})
        counted = await http.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "sk-a"})
        wrong = await http.post("/v1/messages", json=body, headers={"x-api-key": "sk-b"})
        openai_path = await http.post("/tokenize", json={"prompt": "x"}, headers={"x-api-key": "sk-a"})
        by_client = await client.messages.create(**body)  # sends the key as a bearer token
        with pytest.raises(anthropic.AuthenticationError):
            await anthropic.AsyncAnthropic(
                base_url="http://app", api_key="sk-b", http_client=http, max_retries=0
            ).messages.create(**body)
        return plain, header, counted, wrong, openai_path, by_client

    plain, header, counted, wrong, openai_path, by_client = call(keyed, work, api_key="sk-a")
    for reply in (plain, wrong):
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        assert "x-api-key" in reply.json()["error"]["message"]
    assert header.status_code == 200 and counted.status_code == 200 and by_client.content
    assert openai_path.status_code == 401 and openai_path.json()["error"]["code"] == "invalid_api_key"


def test_a_failure_mid_stream_is_an_error_event(llm, app, monkeypatch):
    runner = llm.engine.runner
    real_execute = runner.execute
    poison = llm.tokenizer.encode("poison", add_special_tokens=False)

    def execute(out):
        for r in out.scheduled:
            ids = list(r.prompt_token_ids)
            if any(ids[i : i + len(poison)] == poison for i in range(len(ids))) and r.num_output_tokens:
                raise RuntimeError("injected failure")
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", execute)
    body = {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "poison"}],
        "stream": True,
    }

    async def work(client, http):
        raw = await http.post("/v1/messages", json=body)
        with pytest.raises(anthropic.APIStatusError):
            async with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
                await stream.get_final_message()
        return raw

    sequence = events(call(app, work))
    assert sequence[0][0] == "message_start" and sequence[-1][0] == "error"
    assert sequence[-1][1]["error"]["type"] == "api_error" and "injected" not in json.dumps(sequence[-1][1])
