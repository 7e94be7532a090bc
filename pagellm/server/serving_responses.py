"""OpenAI's Responses API (`POST /v1/responses`, and with `--enable-responses-store` `GET /v1/responses/{id}`
and `POST /v1/responses/{id}/cancel`; vLLM's `serving_responses.py`) over the chat path.

A request becomes a chat completions request (responses_input.py: `instructions` a system turn, the input
items chat turns, function tools OpenAI's chat tools, `text.format` the `response_format` grammar,
`reasoning.effort` the template's `reasoning_effort`), and `ServingResponses` extends serving_chat.py's
`ServingChat`, so the template, sampling, cost check, streams and the reasoning and tool-call parsers are
the chat endpoint's; only the answer is the Responses API's: output items (reasoning, message,
function_call) and `usage`, or their typed event stream (responses_events.py). With the store on, each
response (unless `store: false`) is kept with its conversation (responses_store.py) for
`previous_response_id`, retrieval and cancelling one still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from pagellm.engine.async_llm import RequestStream
from pagellm.engine.outputs import RequestOutput
from pagellm.server import errors
from pagellm.server.protocol import ChatCompletionRequest, ChatResponseMessage
from pagellm.server.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    item_id,
)
from pagellm.server.responses_events import ResponseCancelled, response_events
from pagellm.server.responses_input import assistant_turn, input_messages
from pagellm.server.responses_store import ResponsesStore, StoredResponse
from pagellm.server.serving_base import final_outputs, sse_response
from pagellm.server.serving_chat import ServingChat

# the chat request's field an error names -> the Responses request's
_FIELDS = {
    "messages": "input",
    "prompt": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
_OWN_FIELDS = ("seed", "top_k", "min_p", "repetition_penalty", "logit_bias", "priority")  # as chat's
_STORE_OFF = "this server keeps no responses; start it with --enable-responses-store"


class ServingResponses(ServingChat):
    """POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel."""

    def __init__(self, *args: Any, store: tuple[int, float] | None = None, **kwargs: Any):
        """`store`: (most responses, seconds each) kept (--enable-responses-store); None keeps none."""
        super().__init__(*args, **kwargs)
        self.store = ResponsesStore(*store) if store is not None else None

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Any:
        response_id = f"resp_{uuid.uuid4().hex}"
        stored = self._stores(request)
        history = self._history(request.previous_response_id)
        conversation = history + input_messages(request.input)
        with _responses_fields():
            chat = self._chat_request(request, conversation)
            model, tool_parser, ids, streams = await self.start_chat(chat, response_id)
        response = self.draft(request, response_id, model, stored)
        entry = None
        if stored:
            entry = StoredResponse(response, conversation, cancel=lambda: _cancel(self, streams))
            self.store.put(entry)  # type: ignore[union-attr]
        if request.stream:
            events = response_events(self, response, streams, raw_request, tool_parser, entry)
            return sse_response(events, streams)
        try:
            (output,) = await final_outputs(streams, raw_request)
        except ResponseCancelled:
            return response  # status "cancelled", set by cancel()
        except BaseException:
            response.status = "failed"
            raise
        reply = self.message(output.outputs[0].text, tool_parser, response_id)
        items = output_items(reply, response_id, output.outputs[0].finish_reason)
        await self.finish(response, items, output, len(output.outputs[0].token_ids), reply.reasoning)
        if entry is not None:
            entry.conversation = conversation + assistant_turn(response.output)
        return response

    async def retrieve(self, response_id: str) -> ResponseObject:
        return self._stored(response_id).response

    async def cancel(self, response_id: str) -> ResponseObject:
        """Abort a stored response still running: its request answers what it has so far, as cancelled."""
        entry = self._stored(response_id)
        if entry.response.status != "in_progress":
            raise errors.bad_request(
                f"response {response_id} is {entry.response.status}; only one in progress can be cancelled",
                "response_id",
            )
        entry.response.status = "cancelled"
        if entry.cancel is not None:
            entry.cancel()
        return entry.response

    # -- the response ------------------------------------------------------------------------------------

    def draft(self, request: ResponsesRequest, response_id: str, model: str, stored: bool) -> ResponseObject:
        """The response in progress: the request's settings echoed, no output yet."""
        return ResponseObject(
            id=response_id,
            status="in_progress",
            model=model,
            instructions=request.instructions,
            metadata=request.metadata,
            tools=request.function_tools,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            parallel_tool_calls=request.parallel_tool_calls,
            temperature=request.temperature,
            top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning,
            text=request.text,
            store=stored,
            user=request.user,
        )

    async def finish(
        self,
        response: ResponseObject,
        items: list[OutputItem],
        output: RequestOutput,
        output_tokens: int,
        reasoning: str | None,
    ) -> None:
        """Fill in a finished response: its items, status and usage (the reasoning's tokens counted by
        tokenizing its text, off the event loop)."""
        finish_reason = output.outputs[0].finish_reason
        if response.status == "in_progress":
            response.status = "incomplete" if finish_reason == "length" else "completed"
        if finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.output = items
        response.completed_at = time.time()
        reasoning_tokens = 0
        if reasoning:
            ids = await asyncio.to_thread(self.tokenizer.encode, reasoning, add_special_tokens=False)
            reasoning_tokens = len(ids)
        prompt, cached = len(output.prompt_token_ids), output.num_cached_tokens
        written = prompt - cached if self.llm.config.enable_prefix_caching else 0
        response.usage = ResponseUsage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=written),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=prompt + output_tokens,
        )

    # -- the request -------------------------------------------------------------------------------------

    def _stores(self, request: ResponsesRequest) -> bool:
        """Whether this response is kept: when the server keeps responses, unless the request says not."""
        if self.store is None:
            if request.store:
                raise errors.bad_request(f"store: {_STORE_OFF}, or send store: false", "store")
            return False
        return request.store is not False

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The conversation a previous response ended, to continue; 400/404 naming previous_response_id."""
        if previous_response_id is None:
            return []
        if self.store is None:
            raise errors.bad_request(f"previous_response_id: {_STORE_OFF}", "previous_response_id")
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise errors.APIError(
                404, f"no stored response {previous_response_id!r}", param="previous_response_id"
            )
        if entry.response.status == "in_progress":
            raise errors.bad_request(
                f"response {previous_response_id} has not finished yet", "previous_response_id"
            )
        return copy.deepcopy(entry.conversation)  # rendering turns arguments into objects in place

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id) if self.store is not None else None
        if entry is None:
            why = _STORE_OFF if self.store is None else "it was never stored, or has expired"
            raise errors.APIError(404, f"no stored response {response_id!r}: {why}", param="response_id")
        return entry

    def _chat_request(self, request: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat completions request this is; 400 naming the Responses field it came from."""
        instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
        choice = request.tool_choice
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": instructions + conversation,
            "tools": [{"function": t.model_dump(exclude={"type", "strict"})} for t in request.function_tools]
            or None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if choice is not None and not isinstance(choice, str)
            else choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": request.stream,
            "user": request.user,
            "response_format": _response_format(request),
            **{name: getattr(request, name) for name in _OWN_FIELDS},
        }
        if request.reasoning is not None and request.reasoning.effort is not None:
            fields["chat_template_kwargs"] = {"reasoning_effort": request.reasoning.effort}
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as exc:  # what the input items held, checked as chat messages
            loc = exc.errors()[0].get("loc") or ("messages",)
            raise errors.bad_request(str(exc), str(loc[0])) from exc


def output_items(reply: ChatResponseMessage, response_id: str, finish_reason: str | None) -> list[OutputItem]:
    """A whole reply's output items: its reasoning, its text, its calls (as a stream opens them)."""
    items: list[OutputItem] = []
    if reply.reasoning:
        items.append(
            ReasoningItem(id=item_id("rs", response_id, 0), content=[ReasoningText(text=reply.reasoning)])
        )
    if reply.content:
        message = MessageItem(
            id=item_id("msg", response_id, len(items)), content=[OutputText(text=reply.content)]
        )
        items.append(message)
    for call in reply.tool_calls:
        index = len(items)
        items.append(
            FunctionCallItem(
                id=item_id("fc", response_id, index),
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
            )
        )
    if finish_reason == "length" and items:
        items[-1].status = "incomplete"
    return items


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """text.format as chat's response_format: a JSON schema or any JSON object, through the grammar."""
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise errors.bad_request("text.format of type json_schema needs a schema", "text")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
    }


@contextlib.contextmanager
def _responses_fields() -> Iterator[None]:
    """Errors from the chat path name chat fields; rename them to the Responses request's."""
    try:
        yield
    except errors.APIError as exc:
        exc.info.param = _FIELDS.get(exc.info.param or "", exc.info.param)
        raise


def _cancel(serving: ServingResponses, streams: list[RequestStream]) -> None:
    """Wake each stream's reader with ResponseCancelled and abort its engine request."""
    for stream in streams:
        if not stream.finished:
            stream.put(ResponseCancelled("the response was cancelled"))
            serving.llm.abort(stream.request_id)
