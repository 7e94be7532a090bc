"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat path.

A Messages request becomes a chat completions request (system, text blocks, tool_use and tool_result blocks
become OpenAI turns; tools and tool_choice become OpenAI's) and `ServingMessages` extends serving_chat.py's
`ServingChat`, so the chat template, sampling params, cost check, engine streams and tool-call parsers are
the chat endpoint's own; only the answer is Anthropic's: a
`message` with content blocks, or its event stream (message_start, content_block_start/delta/stop,
message_delta, message_stop). Errors on these paths take Anthropic's body (see errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagellm.core.parsers import ToolParser
from pagellm.engine.async_llm import RequestStream
from pagellm.engine.outputs import CompletionOutput
from pagellm.server import errors
from pagellm.server.protocol import ChatCompletionRequest, ChatResponseMessage, valid_unicode
from pagellm.server.serving_base import final_outputs, merged_outputs, sse_response
from pagellm.server.serving_chat import ReplyStream, ServingChat

# the chat request's field an error names -> the Messages request's
_FIELDS = {"stop": "stop_sequences", "prompt": "messages", "max_completion_tokens": "max_tokens"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, metadata's keys, ... do not matter here


class TextBlock(_Body):
    type: Literal["text"]
    text: str

    _valid_text = field_validator("text")(valid_unicode)


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    _valid_content = field_validator("content")(valid_unicode)


class ImageSource(_Body):
    """An image block's source: base64 data with its media type, or a URL (read under the server's media
    limits, as a chat request's image_url)."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "base64" and not (self.media_type and self.data):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs its url")
        return self

    @property
    def as_url(self) -> str:
        """The image as a chat request's image_url names it."""
        return self.url if self.type == "url" else f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Body):
    type: Literal["image"]
    source: ImageSource


_BLOCK_TYPES = ("text", "image", "thinking", "tool_use", "tool_result")
ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    _valid_content = field_validator("content")(valid_unicode)

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        """Say plainly which blocks this server reads (a document it cannot)."""
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported; send {', '.join(_BLOCK_TYPES)}"
                )
        return content


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the tool\'s name')
        return self


class CountTokensRequest(_Body):
    """What a prompt is made of: `/v1/messages/count_tokens` takes just this."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    _valid_system = field_validator("system")(valid_unicode)

    def to_chat(self, **fields: Any) -> ChatCompletionRequest:
        """The chat completions request this is; 400 naming `messages` for a block in the wrong turn."""
        messages = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for i, message in enumerate(self.messages):
            messages += _openai_turns(message, i)
        choice, parallel = self.tool_choice, True
        if choice is not None:
            parallel = not choice.disable_parallel_tool_use
        tools = None
        if self.tools:
            tools = [
                {"function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools
            ]
        try:
            return ChatCompletionRequest(
                model=self.model,
                messages=messages,
                tools=tools,
                tool_choice=_openai_tool_choice(choice),
                parallel_tool_calls=parallel,
                **fields,
            )
        except ValidationError as exc:  # the blocks were valid, so rarely; still the client's input
            raise errors.bad_request(str(exc), "messages") from exc


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used
    stream: bool = False
    # pagellm's own sampling fields, as on the chat endpoint
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0

    _valid_stops = field_validator("stop_sequences")(valid_unicode)

    def to_chat(self, **fields: Any) -> ChatCompletionRequest:
        own = ("seed", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "priority")
        return super().to_chat(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stream=self.stream,
            **{name: getattr(self, name) for name in own},
            **fields,
        )


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]  # text, thinking and tool_use blocks
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ServingMessages(ServingChat):
    """POST /v1/messages and /v1/messages/count_tokens, served by the chat path (`start_chat`, `message`)."""

    async def messages(self, request: MessagesRequest, raw_request: Request) -> Any:
        message_id = f"msg_{uuid.uuid4().hex}"
        with _anthropic_fields():
            chat = request.to_chat()
            model, tool_parser, ids, streams = await self.start_chat(chat, message_id)
        stops = request.stop_sequences or []
        if request.stream:
            events = self._message_events(
                model, message_id, len(ids), streams, raw_request, tool_parser, stops
            )
            return sse_response(events, streams)
        (output,) = await final_outputs(streams, raw_request)
        sample = output.outputs[0]
        reply = self.message(sample.text, tool_parser)
        stop_reason, stop_sequence = _stop_reason(sample, bool(reply.tool_calls), stops)
        return MessagesResponse(
            id=message_id,
            content=_content(reply, message_id),
            model=model,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=AnthropicUsage(
                input_tokens=len(output.prompt_token_ids), output_tokens=len(sample.token_ids)
            ),
        )

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        with _anthropic_fields():
            chat = request.to_chat()
            self.served.resolve(chat.model)
            tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
            ids = await asyncio.to_thread(self.chat_prompt_ids, chat.messages, None, True, tools)
        return CountTokensResponse(input_tokens=len(ids))

    async def _message_events(
        self,
        model: str,
        message_id: str,
        input_tokens: int,
        streams: list[RequestStream],
        raw_request: Request,
        tool_parser: ToolParser | None,
        stops: list[str],
    ) -> AsyncIterator[str]:
        start = MessagesResponse(
            id=message_id,
            content=[],
            model=model,
            stop_reason="end_turn",
            usage=AnthropicUsage(input_tokens=input_tokens, output_tokens=0),
        ).model_dump()
        yield _event("message_start", message={**start, "stop_reason": None})
        blocks = _Blocks(message_id)
        reply = ReplyStream(self.reasoning, tool_parser, "")
        output_tokens, called = 0, False
        try:
            async with contextlib.aclosing(merged_outputs(streams, raw_request)) as merged:
                async for _, output in merged:
                    for sample in output.outputs:  # n is 1
                        output_tokens += len(sample.token_ids)
                        final = sample.finish_reason is not None
                        thinking, text, deltas = reply.feed(sample.text, final)
                        called |= bool(deltas)
                        for event in blocks.feed(thinking, text, deltas):
                            yield event
                        if final:
                            for event in blocks.close(empty_text=True):
                                yield event
                            reason, sequence = _stop_reason(sample, called, stops)
                            delta = {"stop_reason": reason, "stop_sequence": sequence}
                            yield _event("message_delta", delta=delta, usage={"output_tokens": output_tokens})
                            yield _event("message_stop")
        except Exception as exc:
            yield _event("error", error=errors.anthropic_error(errors.from_exception(exc)).error.model_dump())


class _Blocks:
    """The content blocks of one streamed message: each piece of thinking, text or a tool call continues
    the open block when it is of its kind, else closes it and opens the next (indexes count from 0)."""

    def __init__(self, message_id: str):
        self.message_id = message_id
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def feed(self, thinking: str, text: str, calls: list[dict]) -> Iterator[str]:
        if thinking:
            yield from self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": thinking})
        if text:
            yield from self._start("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": text})
        for call in calls:  # OpenAI's tool-call deltas: a call's first carries its id and name
            if "id" in call:
                name = call["function"]["name"]
                block = {"type": "tool_use", "id": _tool_id(self.message_id, call["index"]), "name": name}
                yield from self._start("tool_use", {**block, "input": {}}, new=True)
            if call["function"]["arguments"]:
                yield self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})

    def close(self, empty_text: bool = False) -> Iterator[str]:
        """Close the open block; with `empty_text`, a message that had none gets one empty text block."""
        if self.open is None and self.index < 0 and empty_text:
            yield from self._start("text", {"type": "text", "text": ""})
        if self.open is not None:
            self.open = None
            yield _event("content_block_stop", index=self.index)

    def _start(self, kind: str, block: dict, new: bool = False) -> Iterator[str]:
        if self.open == kind and not new:
            return
        yield from self.close()
        self.index += 1
        self.open = kind
        yield _event("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@contextlib.contextmanager
def _anthropic_fields() -> Iterator[None]:
    """Errors from the chat path name chat fields; rename them to the Messages request's."""
    try:
        yield
    except errors.APIError as exc:
        exc.info.param = _FIELDS.get(exc.info.param or "", exc.info.param)
        raise


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _openai_turns(message: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    """One Anthropic turn as OpenAI chat turns: a user turn's tool_result blocks become `tool` turns (in
    order, around its text), an assistant turn's tool_use blocks its `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    images: list[dict[str, Any]] = []  # a user turn's content parts, once it has an image
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "text":
            texts.append(block.text)
            if images:
                images.append({"type": "text", "text": block.text})
        elif message.role == "user" and block.type == "image":
            if not images:
                images = [{"type": "text", "text": text} for text in texts]
            images.append({"type": "image_url", "image_url": {"url": block.source.as_url}})
        elif message.role == "assistant" and block.type == "thinking":
            thinking.append(block.thinking)
        elif message.role == "assistant" and block.type == "tool_use":
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input},
                }
            )
        elif message.role == "user" and block.type == "tool_result":
            if images:
                turns.append({"role": "user", "content": images})
                texts, images = [], []
            elif texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        else:
            raise errors.bad_request(
                f"{where}: a {message.role} turn cannot hold a {block.type} block", "messages"
            )
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = "\n".join(thinking)
        return [turn]
    if images:
        turns.append({"role": "user", "content": images})
    elif texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _openai_tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None  # OpenAI's default is Anthropic's: auto when tools are given
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _content(reply: ChatResponseMessage, message_id: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for i, call in enumerate(reply.tool_calls):
        blocks.append(
            {
                "type": "tool_use",
                "id": _tool_id(message_id, i),
                "name": call.function.name,
                "input": _tool_input(call.function.arguments),
            }
        )
    return blocks or [{"type": "text", "text": ""}]


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's input object; {} when the arguments are not one (max_tokens cut them, or the model wrote
    something else: only a grammar makes them valid)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_id(message_id: str, index: int) -> str:
    return f"toolu_{message_id.removeprefix('msg_')[:24]}_{index}"


def _stop_reason(sample: CompletionOutput, called: bool, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sample."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if isinstance(sample.stop_reason, str) and sample.stop_reason in stops:
        return "stop_sequence", sample.stop_reason
    return ("tool_use" if called else "end_turn"), None
