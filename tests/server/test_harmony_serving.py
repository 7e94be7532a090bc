"""GPT-OSS served end to end (the tiny random GPT-OSS of tests/models/tiny.py: harmony chat template and
special tokens), through the official openai client: a forced call is a harmony reply (maybe thinking, then
the call as a commentary message), so it comes back as `tool_calls` with arguments that validate, and its
thinking as `reasoning` / `reasoning_content`, streamed exactly as whole; the analysis channel never shows
in `content`."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai_asgi import call_app

from pagellm.server import harmony
from pagellm.server.app import build_app

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "neg", "parameters": ADD}},
]
MESSAGES = [{"role": "user", "content": "2+3?"}]
# A random model spells harmony's markers byte by byte as readily as with their special tokens, and thinks
# until max_tokens: favour the markers' tokens (<|start|>, <|message|>, <|channel|>, <|constrain|>) and,
# less, <|end|>, which closes the thinking, and "a" and "an", which after <|channel|> open the analysis
# channel. The grammar still decides where each may go.
MARKER_BIAS = {"3": 10, "4": 10, "6": 10, "8": 10, "5": 4, "73": 5, "282": 5}
SEEDS = range(6)


@pytest.fixture(scope="module")
def app(gpt_oss_llm):
    return build_app(
        gpt_oss_llm, ["tiny"], log_requests=False, tool_call_parser="openai", enable_auto_tool_choice=True
    )


async def _whole_and_streamed(client, **kwargs):
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    calls, reasoning, reasoning_content, content, reasons = {}, "", "", "", []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta, extra = choice.delta, choice.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            reasoning_content += extra.get("reasoning_content") or ""
            content += delta.content or ""
            reasons.append(choice.finish_reason)
            for d in delta.tool_calls or []:
                if d.id:
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    calls[d.index][1] += d.function.arguments or ""
    assert reasoning == reasoning_content
    return whole, ([tuple(c) for c in calls.values()], reasoning, content, reasons[-1])


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "neg"}}, "required"])
def test_a_forced_call_is_a_harmony_call_with_its_reasoning(app, choice):
    async def work(client, http):
        replies = []
        for seed in SEEDS:
            kwargs = dict(
                model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=100,
                temperature=1.0, seed=seed, logit_bias=MARKER_BIAS, parallel_tool_calls=False,
            )  # fmt: skip
            replies.append(await _whole_and_streamed(client, **kwargs))
        return replies

    finished = thought = 0
    for whole, streamed in call_app(app, work):
        message, extra = whole.message, whole.message.model_extra or {}
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamed == (calls, extra["reasoning"] or "", "", whole.finish_reason)
        assert message.content is None and extra["reasoning"] == extra["reasoning_content"]
        assert not any(m in (extra["reasoning"] or "") for m in harmony.MARKERS)
        if whole.finish_reason == "length":  # still thinking at max_tokens: the call never came
            continue
        finished += 1
        ((name, arguments),) = calls
        jsonschema.validate(json.loads(arguments), ADD)
        if isinstance(choice, dict):
            assert name == "neg" and whole.finish_reason == "stop"
        else:
            assert name in ("add", "neg") and whole.finish_reason == "tool_calls"
        thought += bool(extra["reasoning"])
    assert finished >= len(SEEDS) // 2 and 0 < thought < finished  # the grammar lets the model choose


def test_without_a_forced_call_the_reply_is_read_as_harmony(app):
    """tool_choice none: no grammar; whatever the random model writes, no marker reaches the client."""

    async def work(client, http):
        return await _whole_and_streamed(
            client, model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=0,
            logit_bias=MARKER_BIAS,
        )  # fmt: skip

    whole, (calls, reasoning, content, reason) = call_app(app, work)
    extra = whole.message.model_extra or {}
    assert calls == [] and reason == whole.finish_reason
    assert (reasoning, content) == (extra["reasoning"] or "", whole.message.content or "")
    assert not any(m in reasoning + content for m in ("<|channel|>", "<|message|>", "<|end|>"))


def test_a_structural_tag_is_checked_before_it_queues(app):
    """`structured_outputs.structural_tag` (what forced harmony calls use) is open to requests too."""

    async def work(client, http):
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
        bad = {"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}
        good = {"structural_tag": harmony.forced_calls_tag([TOOLS[0]["function"]], "add", False)}
        refused = await http.post("/v1/chat/completions", json={**body, "structured_outputs": bad})
        answered = await http.post(
            "/v1/chat/completions", json={**body, "structured_outputs": good, "max_tokens": 60}
        )
        return refused, answered

    refused, answered = call_app(app, work)
    assert refused.status_code == 400 and "structured_outputs.structural_tag" in refused.text
    assert answered.status_code == 200


def test_responses_give_gpt_oss_calls_as_function_call_items_after_reasoning_items(app):
    """/v1/responses over the same path: a forced call is a function_call item with valid JSON, the
    thinking before it a reasoning item, streamed as whole; every body validates as the client's type."""
    from openai.types.responses import Response

    async def work(client, http):
        replies = []
        for seed in SEEDS:
            body = {
                "model": "tiny", "input": "2+3?", "max_output_tokens": 100, "temperature": 1.0, "seed": seed,
                "tools": [{"type": "function", **TOOLS[0]["function"]}], "parallel_tool_calls": False,
                "tool_choice": {"type": "function", "name": "add"}, "logit_bias": MARKER_BIAS,
            }  # fmt: skip
            whole = await http.post("/v1/responses", json=body)
            streamed = await http.post("/v1/responses", json={**body, "stream": True})
            replies.append((Response.model_validate(whole.json()), streamed.text))
        return replies

    thought = 0
    for whole, streamed in call_app(app, work):
        kinds = [item.type for item in whole.output]
        events = [json.loads(b.split("\n")[1][6:]) for b in streamed.strip().split("\n\n")]
        last = Response.model_validate(events[-1]["response"])
        assert [i.type for i in last.output] == kinds
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        if whole.status == "incomplete":  # still thinking at max_output_tokens
            continue
        assert kinds in (["function_call"], ["reasoning", "function_call"])
        call = whole.output[-1]
        assert call.name == "add" and (call.arguments, call.status) == (
            last.output[-1].arguments,
            "completed",
        )
        jsonschema.validate(json.loads(call.arguments), ADD)
        if kinds[0] == "reasoning":
            thought += 1
            assert whole.output[0].content[0].text == reasoning == last.output[0].content[0].text
            assert whole.usage.output_tokens_details.reasoning_tokens > 0
    assert thought


def test_reasoning_effort_reaches_the_chat_template(app):
    """`reasoning.effort` (Responses) and `chat_template_kwargs` (chat) fill the template's
    `reasoning_effort`: "Reasoning: low" is a shorter prompt than the default "Reasoning: medium", by as
    much on both endpoints."""

    async def work(client, http):
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 1}
        plain = await http.post("/v1/responses", json=body)
        low = await http.post("/v1/responses", json={**body, "reasoning": {"effort": "low"}})
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
        kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
        chats = [await http.post("/v1/chat/completions", json=b) for b in (chat, {**chat, **kwargs})]
        return plain.json(), low.json(), [c.json() for c in chats]

    plain, low, (chat, chat_low) = call_app(app, work)
    shorter = plain["usage"]["input_tokens"] - low["usage"]["input_tokens"]
    assert shorter > 0 and chat["usage"]["prompt_tokens"] - chat_low["usage"]["prompt_tokens"] == shorter
