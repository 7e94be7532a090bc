"""A streamed Responses API response: OpenAI's typed server-sent events (`event: TYPE`, its JSON in `data`,
numbered by `sequence_number`).

`response.created` and `response.in_progress` open it; then each output item as the reply grows: a
reasoning item (`response.reasoning_text.delta`/`.done`), a message (`response.content_part.added`,
`response.output_text.delta`/`.done`, `response.content_part.done`) or a function call
(`response.function_call_arguments.delta`/`.done`), each between `response.output_item.added` and
`response.output_item.done`; a piece of another kind closes the open item and opens the next. It ends
with `response.completed` (or `response.incomplete` at max_output_tokens) carrying the whole response, or an
`error` event when it fails or is cancelled after the 200 went out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from fastapi import Request

from pagellm.core.parsers import ReasoningParser, ToolParser
from pagellm.engine.async_llm import RequestStream
from pagellm.engine.outputs import RequestOutput
from pagellm.server import errors
from pagellm.server.protocol_responses import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    item_id,
)
from pagellm.server.responses_input import assistant_turn
from pagellm.server.responses_store import StoredResponse
from pagellm.server.serving_base import merged_outputs
from pagellm.server.serving_chat import ReplyStream


class ResponseFinisher(Protocol):
    """What the event stream needs of `ServingResponses` (named structurally: that module imports this one)."""

    reasoning: ReasoningParser | None

    async def finish(
        self,
        response: ResponseObject,
        items: list[OutputItem],
        output: RequestOutput,
        output_tokens: int,
        reasoning: str | None,
    ) -> None: ...


class ResponseCancelled(Exception):
    """POST /v1/responses/{id}/cancel stopped this response."""


class EventWriter:
    """Server-sent events numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


class OutputItems:
    """The output items of one streamed reply, and the events that open, grow and close them."""

    def __init__(self, response_id: str, event: EventWriter):
        self.item_id = lambda prefix: item_id(prefix, response_id, len(self.items))
        self.event = event
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def feed(self, reasoning: str, text: str, calls: list[dict]) -> Iterator[str]:
        if reasoning:
            if not isinstance(self.open, ReasoningItem):
                item = ReasoningItem(id=self.item_id("rs"), content=[], status="in_progress")
                yield from self._add(item, ReasoningText(text=""))
            self.open.content[0].text += reasoning  # type: ignore[union-attr]
            yield self._part_event("response.reasoning_text.delta", delta=reasoning)
        if text:
            if not isinstance(self.open, MessageItem):
                yield from self._add(
                    MessageItem(id=self.item_id("msg"), status="in_progress"), OutputText(text="")
                )
            self.open.content[0].text += text  # type: ignore[union-attr]
            yield self._part_event("response.output_text.delta", delta=text, logprobs=[])
        for call in calls:  # OpenAI's chat tool-call deltas: a call's first carries its id and name
            function = call["function"]
            if "id" in call:
                item = FunctionCallItem(
                    id=self.item_id("fc"),
                    call_id=call["id"],
                    name=function["name"],
                    arguments="",
                    status="in_progress",
                )
                yield from self._add(item, None)
            if function["arguments"]:
                self.open.arguments += function["arguments"]  # type: ignore[union-attr]
                yield self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open.id,  # type: ignore[union-attr]
                    output_index=len(self.items) - 1,
                    delta=function["arguments"],
                )

    def close(self, status: str = "completed") -> Iterator[str]:
        """Close the open item (`status`: completed, or incomplete when the reply was cut)."""
        item, index = self.open, len(self.items) - 1
        if item is None:
            return
        self.open = None
        item.status = status  # type: ignore[assignment]
        if isinstance(item, FunctionCallItem):
            yield self.event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                name=item.name,
                arguments=item.arguments,
            )
        else:
            part = item.content[0]
            done = (
                "response.reasoning_text.done"
                if isinstance(item, ReasoningItem)
                else "response.output_text.done"
            )
            extra = {} if isinstance(item, ReasoningItem) else {"logprobs": []}
            yield self._part_event(done, index=index, text=part.text, **extra)
            yield self._part_event("response.content_part.done", index=index, part=part.model_dump())
        yield self.event("response.output_item.done", output_index=index, item=item.model_dump())

    def _add(self, item: OutputItem, part: OutputText | ReasoningText | None) -> Iterator[str]:
        yield from self.close()
        self.items.append(item)
        self.open = item
        yield self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()
        )
        if part is not None:
            item.content.append(part)  # type: ignore[union-attr]
            yield self._part_event("response.content_part.added", part=part.model_dump())

    def _part_event(self, kind: str, index: int | None = None, **data: Any) -> str:
        index = len(self.items) - 1 if index is None else index
        return self.event(kind, item_id=self.items[index].id, output_index=index, content_index=0, **data)


async def response_events(
    serving: ResponseFinisher,
    response: ResponseObject,
    streams: list[RequestStream],
    raw_request: Request,
    tool_parser: ToolParser | None,
    entry: StoredResponse | None,
) -> AsyncIterator[str]:
    """The events of one streamed response (n is 1); `entry`, when stored, gets the finished conversation."""
    event = EventWriter()
    yield event("response.created", response=response.model_dump())
    yield event("response.in_progress", response=response.model_dump())
    items = OutputItems(response.id, event)
    reply = ReplyStream(serving.reasoning, tool_parser, response.id)
    output_tokens, last = 0, None
    try:
        async with contextlib.aclosing(merged_outputs(streams, raw_request)) as merged:
            async for _, output in merged:
                sample = output.outputs[0]
                output_tokens += len(sample.token_ids)
                final = sample.finish_reason is not None
                for piece in items.feed(*reply.feed(sample.text, final)):
                    yield piece
                if final:
                    last = output
    except Exception as exc:
        response.output = items.items
        if isinstance(exc, ResponseCancelled):  # cancel() set the status
            yield event("error", message=str(exc), type="invalid_request_error", param=None, code="cancelled")
        else:
            response.status = "failed"
            yield event("error", **errors.from_exception(exc).info.model_dump())
        return
    if last is None:  # aborted without an error (the client went away): nobody reads what follows
        response.status = "failed"
        return
    cut = last.outputs[0].finish_reason == "length"
    for piece in items.close("incomplete" if cut else "completed"):
        yield piece
    reasoning = "\n".join(i.content[0].text for i in items.items if isinstance(i, ReasoningItem))
    await serving.finish(response, items.items, last, output_tokens, reasoning)
    if entry is not None:
        entry.conversation = entry.conversation + assistant_turn(response.output)
    done = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield event(done, response=response.model_dump())
