"""Tool calling: the parsers (whole and streamed under every chunking give the same calls), tool_choice
required and named through the official openai client (arguments always validate), streamed tool-call
deltas in OpenAI's format, auto's server flags, and tool turns accepted back in the conversation."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from openai_asgi import call_app
from tool_call_deltas import gather_tool_call_deltas

from pagellm import AsyncLLM
from pagellm.server.app import build_app
from pagellm.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
)

HERMES = [
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {"x": "}{<tool_call>"}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "cut", "arguments": {"q": "unfini',  # max_tokens hit mid-call
    "No calls here, just text with a < sign.",
    '<tool_call>{"arguments": {"k": [1, 2]}, "name": "late"}</tool_call>',
]
LLAMA3 = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {"s": "x;y"}}',
    "Plain answer, no JSON.",
    '{"name": "f", "arguments": {"nested": {"deep": [1, {"z": "}"}]}}}',
]


def _chunkings(text: str, seed: int):
    """Whole, per token of the tiny tokenizer, per character, and at random cuts."""
    from tiny import make_tokenizer

    yield [text]
    spans = make_tokenizer()(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    cuts = sorted({b for _, b in spans if 0 < b < len(text)})
    yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(15):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(parser, chunks):
    stream = ToolCallStream(parser, "x")
    content, calls = "", {}
    for j, piece in enumerate(chunks):
        text, deltas = stream.feed(piece, final=j == len(chunks) - 1)
        content += text
        gather_tool_call_deltas(deltas, calls)
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("parser, texts", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA3)])
def test_streamed_calls_concatenate_to_the_whole_parse_under_every_chunking(parser, texts):
    for i, text in enumerate(texts):
        whole = parser.parse(text, final=True)
        for chunks in _chunkings(text, i):
            assert _streamed(parser, chunks) == (whole.content, whole.calls), (text, chunks)


def test_parsers_find_names_and_arguments():
    parsed = HermesToolParser().parse(HERMES[0])
    assert parsed.content == "Let me check."
    assert [(n, json.loads(a)) for n, a in parsed.calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert [n for n, _ in HermesToolParser().parse(HERMES[1]).calls] == ["a", "b"]
    assert json.loads(HermesToolParser().parse(HERMES[4]).calls[0][1]) == {"k": [1, 2]}
    assert HermesToolParser().parse(HERMES[3]).calls == []
    calls = Llama3JsonToolParser().parse(LLAMA3[1]).calls
    assert [(n, json.loads(a)) for n, a in calls] == [("a", {"n": 1}), ("b", {"s": "x;y"})]
    assert Llama3JsonToolParser().parse(LLAMA3[2]).content == LLAMA3[2]
    required = RequiredToolParser().parse(
        '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    )
    assert required.calls == [("f", '{"a": 1}'), ("g", "{}")]
    assert NamedToolParser("f").parse(' {"a": 1} ').calls == [("f", '{"a": 1}')]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = AsyncLLM(
        str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_model_len=512, engine_process=False
    )
    yield llm
    llm.shutdown()


def test_required_and_named_tool_choice_always_give_valid_calls(llm):
    app = build_app(llm, ["tiny"], log_requests=False)

    async def work(client, http):
        replies = []
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            for seed in range(3):
                reply = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=400,
                    temperature=1.0, seed=seed,
                )  # fmt: skip
                replies.append((choice, reply.choices[0]))
        return replies

    for choice, reply in call_app(app, work):
        calls = reply.message.tool_calls
        assert calls, reply
        for c in calls:
            assert c.type == "function" and c.id
            jsonschema.validate(json.loads(c.function.arguments, strict=False), SCHEMAS[c.function.name])
        if choice == "required":
            assert reply.finish_reason == "tool_calls" and reply.message.content is None
        else:
            assert [c.function.name for c in calls] == ["add"] and reply.finish_reason == "stop"


def test_streamed_tool_call_deltas_match_the_whole_reply(llm):
    app = build_app(llm, ["tiny"], log_requests=False)

    async def work(client, http):
        kwargs = dict(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=300,
            temperature=0,
        )
        whole = (await client.chat.completions.create(**kwargs)).choices[0]
        calls, reasons = {}, []
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasons.append(choice.finish_reason)
                for d in choice.delta.tool_calls or []:
                    if d.id:
                        calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                    else:
                        calls[d.index][2] += d.function.arguments or ""
        return whole, calls, reasons

    whole, calls, reasons = call_app(app, work)
    assert [(n, a) for _, n, a in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert reasons[-1] == "tool_calls"


def test_auto_needs_the_server_flags_and_tool_turns_come_back(llm):
    plain = build_app(llm, ["tiny"], log_requests=False)
    auto = build_app(
        llm, ["tiny"], log_requests=False, tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip

    async def work(client, http):
        refused = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS}
        )
        return refused

    refused = call_app(plain, work)
    assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]

    async def work_auto(client, http):
        return await client.chat.completions.create(model="tiny", messages=turns, tools=TOOLS, max_tokens=8)

    reply = call_app(auto, work_auto)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_an_unknown_tool_in_tool_choice_is_a_400(llm):
    app = build_app(llm, ["tiny"], log_requests=False)

    async def work(client, http):
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        }
        return await http.post("/v1/chat/completions", json=body)

    response = call_app(app, work)
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"]
