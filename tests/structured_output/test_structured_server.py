"""Structured output through the OpenAI API: `response_format` with the official client, vLLM's
`structured_outputs` and `guided_*` extra fields, and a 400 naming the problem for a bad grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai_asgi import call_app
from test_structured_output import SCHEMAS
from tiny import make_tiny_checkpoint

from pagellm import AsyncLLM
from pagellm.server.app import build_app


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("so-serve"))
    llm = AsyncLLM(str(path), dtype="float32", num_kv_blocks=128, max_model_len=512, engine_process=False)
    yield build_app(llm, ["tiny"], log_requests=False)
    llm.shutdown()


def test_response_format_json_schema_through_the_openai_client(app):
    schema = SCHEMAS[0]

    async def work(client, http):
        reply = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "A user, please."}],
            max_tokens=300,
            temperature=0.9,
            seed=4,
            n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema}},
            extra_body={"structured_outputs": None},
        )
        return [c.message.content for c in reply.choices]

    for text in call_app(app, work):
        jsonschema.validate(json.loads(text, strict=False), schema)


def test_structured_outputs_and_guided_fields_on_completions(app):
    async def work(client, http):
        texts = {}
        for name, extra in (
            ("choice", {"structured_outputs": {"choice": ["left", "right"]}}),
            ("regex", {"guided_regex": r"\d{3}-[a-z]{2}"}),
            ("guided_choice", {"guided_choice": ["up", "down"]}),
        ):
            reply = await client.completions.create(
                model="tiny", prompt="Which way?", max_tokens=20, temperature=1.0, seed=2, extra_body=extra
            )
            texts[name] = reply.choices[0].text
        stream = await client.completions.create(
            model="tiny",
            prompt="Which way?",
            max_tokens=20,
            stream=True,
            extra_body={"guided_regex": r"[a-c]{4}"},
        )
        texts["streamed"] = "".join([chunk.choices[0].text async for chunk in stream])
        return texts

    texts = call_app(app, work)
    assert texts["choice"] in ("left", "right") and texts["guided_choice"] in ("up", "down")
    assert re.fullmatch(r"\d{3}-[a-z]{2}", texts["regex"]) and re.fullmatch(r"[a-c]{4}", texts["streamed"])


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "json",
        ),
        ({"guided_regex": "(unclosed"}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "not several"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_the_problem(app, body, message):
    async def work(client, http):
        response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **body})
        ok = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        return response, ok

    response, ok = call_app(app, work)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert ok.status_code == 200  # the server carries on
