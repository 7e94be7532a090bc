"""Ollama's API beside OpenAI's, on the same engine: `/api/chat`, `/api/generate` and `/api/embed`, served
by the chat, completion and embedding paths (ollama_requests.py maps the requests), streamed as Ollama
streams (NDJSON, one JSON object a line, the default) or whole with `"stream": false`. The model routes
(`/api/tags`, `/api/show`, `/api/ps`, `/api/version`) are ollama_models.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pagellm.core.parsers import ToolParser
from pagellm.core.pooling import PoolingParams
from pagellm.engine.async_llm import RequestStream
from pagellm.engine.outputs import RequestOutput
from pagellm.server import errors
from pagellm.server.ollama_requests import (
    chat_request,
    completion_request,
    generate_chat_request,
    ollama_field,
)
from pagellm.server.protocol import ChatCompletionRequest, ChatResponseMessage, CompletionRequest
from pagellm.server.protocol_ollama import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    OllamaGenerateRequest,
    OllamaResponseMessage,
    OllamaToolCall,
)
from pagellm.server.serving_base import abort_all, final_outputs, merged_outputs
from pagellm.server.serving_chat import ReplyStream, ServingChat
from pagellm.server.serving_embedding import ServingEmbedding


class ServingOllama:
    """Ollama's generating and embedding routes over the server's chat and embedding serving objects."""

    def __init__(self, chat: ServingChat, embedding: ServingEmbedding):
        self.chat = chat
        self.embedding = embedding

    async def api_chat(self, body: OllamaChatRequest, raw_request: Request) -> Any:
        model = self._model(body.model)
        with ollama_fields():
            request = chat_request(body)
        request.model = model
        return await self._answer(request, model, raw_request, "chat")

    async def api_generate(self, body: OllamaGenerateRequest, raw_request: Request) -> Any:
        model = self._model(body.model)
        for name in ("template", "context"):
            if getattr(body, name):
                raise errors.bad_request(f"pagellm does not take {name}; leave it out", name)
        if not body.prompt and not body.images and not body.suffix:  # Ollama's way to load a model
            return JSONResponse(
                {"model": model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
            )
        raw = body.raw or body.suffix is not None
        build = completion_request if raw else generate_chat_request
        with ollama_fields():
            request = build(body)
        request.model = model
        return await self._answer(request, model, raw_request, "generate")

    async def api_embed(self, body: OllamaEmbedRequest, raw_request: Request) -> OllamaEmbedResponse:
        model = self._model(body.model)
        self.embedding.check_pooling_runner("embeddings")
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        prompts = await asyncio.to_thread(self.embedding.tokenize_prompts, texts)
        if body.truncate:
            prompts = [(None, ids[: self.chat.llm.max_model_len]) for _, ids in prompts]
        started = time.monotonic_ns()
        params = PoolingParams(dimensions=body.dimensions)
        finals = await self.embedding.pool(
            f"embed-{uuid.uuid4().hex}", prompts, params, 0, "input", model, raw_request
        )
        return OllamaEmbedResponse(
            model=model,
            embeddings=[o.outputs.embedding for o in finals],
            total_duration=time.monotonic_ns() - started,
            load_duration=0,
            prompt_eval_count=sum(len(o.prompt_token_ids) for o in finals),
        )

    # -- the parts --------------------------------------------------------------------------------------

    def _model(self, name: str | None) -> str:
        """The served model a request names, Ollama's `:latest` tag allowed."""
        served = self.chat.served
        if name and name.endswith(":latest") and name not in served.names and name not in served.loras:
            name = name.removesuffix(":latest")
        return served.resolve(name or None)

    async def _answer(
        self, request: ChatCompletionRequest | CompletionRequest, model: str, raw_request: Request, kind: str
    ) -> Any:
        started = time.monotonic_ns()
        with ollama_fields():
            tool_parser, streams = await self._start(request)
        reasoning = self.chat.reasoning if isinstance(request, ChatCompletionRequest) else None
        reply = OllamaReply(self.chat, model, kind, started, tool_parser, reasoning is not None)
        if request.stream:
            lines = reply.lines(streams, raw_request)
            return StreamingResponse(
                _closing(lines, streams),
                media_type="application/x-ndjson",
                background=BackgroundTask(abort_all, streams),
            )
        (output,) = await final_outputs(streams, raw_request)
        return JSONResponse(reply.whole(output))

    async def _start(
        self, request: ChatCompletionRequest | CompletionRequest
    ) -> tuple[ToolParser | None, list[RequestStream]]:
        """The engine request: through the chat path, or the completion path's checks for a raw prompt."""
        if isinstance(request, ChatCompletionRequest):
            _, tool_parser, _, streams = await self.chat.start_chat(request, f"ollama-{uuid.uuid4().hex}")
            return tool_parser, streams
        chat = self.chat
        params = chat.sampling_params(request, "logprobs")
        if request.suffix is not None and chat.fim_ids is None:
            raise errors.bad_request(
                "suffix needs a model whose tokenizer has fill-in-the-middle tokens", "suffix"
            )
        prompts = await asyncio.to_thread(chat.tokenize_prompts, request.prompts(), request.suffix)
        chat.check_cost(prompts, params)
        lora = chat.served.lora(request.model or chat.served.names[0])
        return None, await chat.add_requests(f"ollama-{uuid.uuid4().hex}", prompts, params, 0, "prompt", lora)


class OllamaReply:
    """One reply in Ollama's shape: a chat `message` or a generate `response`, its thinking apart (with a
    reasoning parser), its tool calls (arguments as objects), and the last line's counts and durations."""

    def __init__(
        self,
        chat: ServingChat,
        model: str,
        kind: str,
        started: int,
        tool_parser: ToolParser | None,
        thinks: bool,
    ):
        self.chat, self.model, self.kind, self.started = chat, model, kind, started
        self.tool_parser, self.thinks = tool_parser, thinks
        self.first_token: int | None = None

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        sample = output.outputs[0]
        metrics = output.metrics
        if metrics is not None and metrics.first_token_time is not None:
            self.first_token = self.started + int((metrics.first_token_time - metrics.arrival_time) * 1e9)
        message = self._message(sample.text)
        done = self._done(sample.finish_reason, len(output.prompt_token_ids), len(sample.token_ids))
        return {**self._body(message), **done}

    async def lines(self, streams: list[RequestStream], raw_request: Request) -> AsyncIterator[str]:
        """NDJSON: a line per piece of text as it comes (a reply that may call tools comes whole at the
        end: its calls are known then), then the done line; an error after the 200 is a line of its own."""
        reply = ReplyStream(self.chat.reasoning if self.thinks else None, None, "")
        whole, prompt_tokens, tokens, reason = [], 0, 0, None
        try:
            async with contextlib.aclosing(merged_outputs(streams, raw_request)) as merged:
                async for _, output in merged:
                    sample = output.outputs[0]
                    self.first_token = self.first_token or time.monotonic_ns()
                    prompt_tokens, tokens = len(output.prompt_token_ids), tokens + len(sample.token_ids)
                    reason = sample.finish_reason
                    whole.append(sample.text)
                    if self.tool_parser is None:
                        thinking, content, _ = reply.feed(sample.text, reason is not None)
                        if thinking or content:
                            yield _line(
                                self._body(ChatResponseMessage(content=content, reasoning=thinking or None))
                            )
        except Exception as exc:
            yield _line({"error": errors.ollama_error(errors.from_exception(exc)).error})
            return
        if self.tool_parser is not None:
            yield _line(self._body(self._message("".join(whole))))
        yield _line(
            {**self._body(ChatResponseMessage(content="")), **self._done(reason, prompt_tokens, tokens)}
        )

    def _message(self, text: str) -> ChatResponseMessage:
        if self.kind == "generate" and not self.thinks:
            return ChatResponseMessage(content=text)
        return self.chat.message(text, self.tool_parser)

    def _body(self, message: ChatResponseMessage) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.kind == "generate":
            body["response"] = message.content or ""
            if message.reasoning:
                body["thinking"] = message.reasoning
        else:
            calls = [_tool_call(c.function.name, c.function.arguments) for c in message.tool_calls]
            reply = OllamaResponseMessage(
                content=message.content or "",
                thinking=message.reasoning,
                tool_calls=[c for c in calls if c] or None,
            )
            body["message"] = reply.model_dump(exclude_none=True)
        return {**body, "done": False}

    def _done(self, finish_reason: str | None, prompt_tokens: int, tokens: int) -> dict[str, Any]:
        ended = time.monotonic_ns()
        first = self.first_token or ended
        return {
            "done": True,
            "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": ended - self.started,
            "load_duration": 0,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": tokens,
            "eval_duration": ended - first,
        }


@contextlib.contextmanager
def ollama_fields() -> Iterator[None]:
    """A refusal inside names the field as the Ollama request spells it (options.num_predict, format)."""
    try:
        yield
    except errors.APIError as exc:
        exc.info.param = ollama_field(exc.info.param)
        raise


def _tool_call(name: str, arguments: str) -> OllamaToolCall | None:
    """Ollama's call, its arguments an object; None for arguments that are not a JSON object."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return OllamaToolCall(function={"name": name, "arguments": parsed}) if isinstance(parsed, dict) else None


async def _closing(lines: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    try:
        async for line in lines:
            yield line
    finally:
        abort_all(streams)


def _line(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def json_or_lines(model: type, description: str) -> dict[int | str, dict[str, Any]]:
    """The 200 of /api/chat and /api/generate: one JSON object with `"stream": false`, else NDJSON lines
    (each one such object, the last with `done: true`)."""
    lines = {"application/x-ndjson": {"schema": {"type": "string"}}}
    return {200: {"model": model, "description": description, "content": lines}}
