"""`/v1/responses` through the official openai client and raw HTTP, every body and event validated with the
client's own pydantic types: text in and out, streamed exactly as whole with the typed event sequence; a
forced function call, its output sent back (whole input, or `previous_response_id` with the store on);
`text.format` through the grammar; the store's retrieval, cancelling and bounds; and a 400 naming the field
for what is not served."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai_asgi import call_app
from pydantic import TypeAdapter

from pagellm.server.app import build_app
from pagellm.server.protocol_responses import ResponseObject
from pagellm.server.responses_store import ResponsesStore, StoredResponse

EVENT = TypeAdapter(ResponseStreamEvent)
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "add", "description": "Add", "parameters": ADD}]
FORCED = {"type": "function", "name": "add"}


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False, responses_store=(1000, 3600.0))


@pytest.fixture(scope="module")
def storeless_app(llm):
    return build_app(llm, ["tiny"], log_requests=False)


def _events(text: str) -> list:
    """The events of a streamed body, each validated as the client's type (its `event:` line its type)."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


async def _whole_and_streamed(http, body: dict) -> tuple[Response, list]:
    whole = await http.post("/v1/responses", json=body)
    assert whole.status_code == 200, whole.text
    streamed = await http.post("/v1/responses", json={**body, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    return Response.model_validate(whole.json()), _events(streamed.text)


def _same_output(whole: Response, events: list) -> None:
    """The stream's last event carries the same output and usage as the whole response."""
    last = events[-1].response

    def strip(items: list) -> list[dict]:  # ids differ between two responses
        return [{k: v for k, v in i.to_dict().items() if k not in ("id", "call_id")} for i in items]

    assert strip(last.output) == strip(whole.output)
    assert (last.status, last.usage.output_tokens) == (whole.status, whole.usage.output_tokens)


def test_text_in_text_out_streamed_as_whole(app):
    body = {
        "model": "tiny",
        "input": "Hello",
        "instructions": "Be brief.",
        "max_output_tokens": 6,
        "temperature": 0,
    }
    whole, events = call_app(app, lambda client, http: _whole_and_streamed(http, body))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    (message,) = whole.output
    assert message.type == "message" and whole.output_text == message.content[0].text
    assert (
        whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0 and whole.instructions == "Be brief."
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    _same_output(whole, events)


def test_a_forced_call_and_its_output_sent_back(app):
    async def work(client, http):
        body = {"model": "tiny", "input": "Add", "tools": TOOLS, "tool_choice": FORCED, "temperature": 0}
        whole, events = await _whole_and_streamed(http, {**body, "max_output_tokens": 40})
        (call,) = whole.output
        items = [{"role": "user", "content": [{"type": "input_text", "text": "Add"}]}, call.model_dump()]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "7"})
        resent = await client.responses.create(
            model="tiny", input=items, max_output_tokens=4, tools=TOOLS, tool_choice="none"
        )
        followed = await client.responses.create(
            model="tiny", previous_response_id=whole.id, max_output_tokens=4, tools=TOOLS, tool_choice="none",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}],
        )  # fmt: skip
        stored = await http.get(f"/v1/responses/{followed.id}")
        return whole, events, resent, followed, stored

    whole, events, resent, followed, stored = call_app(app, work)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    _same_output(whole, events)
    for later in (resent, followed):
        Response.model_validate(later.to_dict())
        assert later.status in ("completed", "incomplete") and later.usage.input_tokens > 0
    assert followed.previous_response_id == whole.id
    assert followed.usage.input_tokens > resent.usage.input_tokens - 8  # the call and its output are in it
    assert Response.model_validate(stored.json()).id == followed.id


def test_text_format_json_schema_goes_through_the_grammar(app):
    text = {"format": {"type": "json_schema", "name": "add", "schema": ADD, "strict": True}}

    async def work(client, http):
        return await client.responses.create(
            model="tiny", input="JSON please", text=text, max_output_tokens=100, temperature=0
        )

    response = call_app(app, work)
    Response.model_validate(response.to_dict())
    assert response.status == "completed"  # the grammar ended it
    jsonschema.validate(json.loads(response.output_text), ADD)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_what_is_not_served_is_a_4xx_naming_the_field(app, extra, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra}
    response = call_app(app, lambda client, http: http.post("/v1/responses", json=body))
    assert response.status_code == (404 if param == "previous_response_id" else 400), response.text
    assert response.json()["error"]["param"] == param


def test_without_the_store_nothing_is_kept(storeless_app):
    async def work(client, http):
        made = await client.responses.create(model="tiny", input="hi", max_output_tokens=2)
        asked = await http.post("/v1/responses", json={"model": "tiny", "input": "hi", "store": True})
        followed = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": made.id})
        return made, asked, followed, await http.get(f"/v1/responses/{made.id}")

    made, asked, followed, fetched = call_app(storeless_app, work)
    assert made.store is False
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "store"
    assert followed.status_code == 400 and followed.json()["error"]["param"] == "previous_response_id"
    assert fetched.status_code == 404 and "--enable-responses-store" in fetched.text


def _store_of(app) -> ResponsesStore:
    (route,) = [r for r in app.routes if getattr(r, "path", None) == "/v1/responses"]
    return route.endpoint.__self__.store


@pytest.mark.parametrize("stream", [False, True])
def test_store_false_and_cancelling_a_running_response(app, stream):
    store = _store_of(app)

    async def cancel_the_running_one(http):
        while not (running := [e for e in store._entries.values() if e.response.status == "in_progress"]):
            await asyncio.sleep(0)
        return await http.post(f"/v1/responses/{running[0].response.id}/cancel")

    async def work(client, http):
        unstored = await client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
        missing = await http.get(f"/v1/responses/{unstored.id}")
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 100, "stream": stream}
        answered, cancelled = await asyncio.gather(
            http.post("/v1/responses", json=body), cancel_the_running_one(http)
        )
        response_id = cancelled.json()["id"]
        again = await http.post(f"/v1/responses/{response_id}/cancel")
        return missing, answered, cancelled, again, await http.get(f"/v1/responses/{response_id}")

    missing, answered, cancelled, again, fetched = call_app(app, work)
    assert missing.status_code == 404 and "never stored" in missing.text
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    if stream:
        events = answered.text.strip().split("\n\n")
        assert events[-1].startswith("event: error") and '"code": "cancelled"' in events[-1]
    else:
        assert Response.model_validate(answered.json()).status == "cancelled"
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"
    fetched = Response.model_validate(fetched.json())
    assert fetched.status == "cancelled" and (fetched.usage is None or fetched.usage.output_tokens < 100)


def test_the_store_is_bounded_in_size_and_age():
    store = ResponsesStore(max_entries=2, max_age_s=60)
    entries = [
        StoredResponse(ResponseObject(id=f"r{i}", status="completed", model="m"), []) for i in range(3)
    ]
    for entry in entries:
        store.put(entry)
    assert (store.get("r0"), len(store)) == (None, 2)
    entries[1].made_at -= 61
    assert store.get("r1") is None and store.get("r2") is entries[2]
    with pytest.raises(ValueError):
        ResponsesStore(max_entries=0)
    asyncio.run(asyncio.sleep(0))


def test_the_routes_are_in_the_openapi_schema(storeless_app):
    """Registered whether the store is on or not (without it, GET and cancel answer 404)."""
    schema = call_app(storeless_app, lambda client, http: http.get("/openapi.json")).json()
    paths = schema["paths"]
    assert "post" in paths["/v1/responses"] and "get" in paths["/v1/responses/{response_id}"]
    assert "post" in paths["/v1/responses/{response_id}/cancel"]
    streamed = paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
