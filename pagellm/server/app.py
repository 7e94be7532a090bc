"""The OpenAI-compatible FastAPI app over an AsyncLLM.

Every request is tokenized here (in a worker thread: a long prompt must not stall the event loop), bounded
(body size, `n`, and what its samples may hold of the KV cache), validated by the engine before a response
starts (so bad input answers 400, not a broken stream), and aborted when its client disconnects, mid-stream
or before its first token.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.core.pooling import PoolingParams
from pagellm.engine.async_llm import AsyncLLM, RequestStream
from pagellm.engine.beam_search import BeamSearchOutput, async_llm_step, beam_search_async, check_fits
from pagellm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.engine.processor import PromptTooLongError
from pagellm.engine.setup import reasoning_parser
from pagellm.lora.adapter import load_adapter
from pagellm.lora.request import LoRARequest
from pagellm.plugins.loader import load_plugins
from pagellm.sampling.params import BeamSearchParams, SamplingParams
from pagellm.server import errors
from pagellm.server.limits import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_N
from pagellm.server.metrics import PrometheusStatLogger
from pagellm.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorResponse,
    LoadLoRARequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
    UnloadLoRARequest,
    UsageInfo,
    VersionResponse,
)
from pagellm.server.reasoning import ReasoningStream
from pagellm.server.tool_parsers import NamedToolParser, RequiredToolParser, ToolCallStream, call_id

logger = logging.getLogger("pagellm")

OPEN_PATHS = ("/health", "/metrics")  # answered without an API key
_MIN_LOGPROB = -9999.0  # JSON has no -inf
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one embeddings request's inputs
CLIENT_CLOSED_REQUEST = 499  # nobody reads it; it keeps the log free of tracebacks
FIM_TOKENS = (  # fill-in-the-middle (prefix, suffix, middle) tokens, as tokenizers spell them
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def build_app(
    llm: AsyncLLM,
    served_model_names: Sequence[str],
    *,
    api_keys: Sequence[str] = (),
    chat_template: str | None = None,
    log_requests: bool = True,
    max_n: int = DEFAULT_MAX_N,
    max_body_bytes: int = DEFAULT_MAX_BODY_MB * 2**20,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The app serving `llm` under `served_model_names` (the first is the default for requests naming none).

    With `api_keys`, every path but /health and /metrics needs `Authorization: Bearer <one of them>`. Bodies
    over `max_body_bytes` get 413, requests for more than `max_n` samples 400."""
    from pagellm import __version__

    if not served_model_names:
        raise ValueError("served_model_names needs at least one name")
    server = _Server(llm, list(served_model_names), chat_template, log_requests, max_n)
    server.tool_parser = _tool_parser(tool_call_parser)
    server.enable_auto_tool_choice = enable_auto_tool_choice
    for name, path in (lora_modules or {}).items():
        server.register_lora(name, path)
    app = FastAPI(title="pagellm", version=__version__, docs_url=None, redoc_url=None)
    errors.install_handlers(app)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)

    keyed = errors.openapi_errors(401, 500)
    posted = errors.openapi_errors(400, 401, 404, 413, 500)
    health = {200: {"description": "The engine runs; the body is empty.", "content": None}}
    app.get("/health", response_class=Response, responses={**health, **errors.openapi_errors(503)})(
        server.health
    )
    app.get("/version", responses=keyed)(server.version)
    app.get("/metrics", response_class=PlainTextResponse)(server.metrics)
    app.get("/v1/models", responses=keyed)(server.models)
    app.post("/v1/completions", responses={**_json_or_events(CompletionResponse), **posted})(
        server.completions
    )
    app.post("/v1/chat/completions", responses={**_json_or_events(ChatCompletionResponse), **posted})(
        server.chat_completions
    )
    if allow_runtime_lora_updating:
        app.post("/v1/load_lora_adapter", responses=posted)(server.load_lora_adapter)
        app.post("/v1/unload_lora_adapter", responses=posted)(server.unload_lora_adapter)
    app.post("/tokenize", responses=posted)(server.tokenize)
    app.post("/detokenize", responses=posted)(server.detokenize)
    app.post("/v1/embeddings", responses=posted)(server.embeddings)
    from pagellm.server import anthropic  # it builds on this module's _Server

    anthropic.add_routes(app, server)
    _document_400_not_422(app)
    return app


def _json_or_events(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 of an endpoint that answers JSON, or server-sent events with `"stream": true`."""
    events = {"text/event-stream": {"schema": {"type": "string"}}}
    return {200: {"model": model, "description": "The response, or its chunks as events", "content": events}}


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents 422 for invalid bodies; this app answers them with 400 (as OpenAI does)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class APIKeyMiddleware:
    """401 unless the request carries one of the keys; keys are compared in constant time."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        await errors.error_response(errors.invalid_api_key(path), path=path)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY`; on Anthropic's paths also `x-api-key: KEY`, as its clients send."""
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = [token.strip().encode() if scheme.lower() == "bearer" else b""]
        if errors.is_anthropic(scope["path"]):
            given.append(headers.get("x-api-key", "").strip().encode())
        match = False
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            for candidate in given:
                match |= hmac.compare_digest(candidate, key)
        return match


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once when its Content-Length says so, or as soon as a chunked body
    grows past it, so an oversized body is never read whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = errors.body_too_large(self.max_bytes)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await errors.error_response(too_large, path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI lets an HTTPException from reading the body through
                raise StarletteHTTPException(too_large.status, too_large.info.message)
            return message

        await self.app(scope, receive_limited, send)


class _Server:
    def __init__(
        self, llm: AsyncLLM, names: list[str], chat_template: str | None, log_requests: bool, max_n: int
    ):
        self.llm = llm
        self.names = names
        self.chat_template = chat_template
        self.log_requests = log_requests
        self.max_n = max_n
        self.tokenizer = llm.tokenizer
        self.reasoning = _reasoning_parser(llm)
        self.tool_parser: Any = None  # --tool-call-parser, for tool_choice auto
        self.loras: dict[str, LoRARequest] = {}  # served adapter name -> its request
        self._lora_ids = itertools.count(1)
        self.enable_auto_tool_choice = False
        self.stat_logger = PrometheusStatLogger(names[0])
        llm.add_stat_logger(self.stat_logger)

    # -- plain endpoints --------------------------------------------------------------------------------

    async def health(self) -> Response:
        if self.llm.is_running:
            return Response(status_code=HTTPStatus.OK)
        return errors.error_response(
            errors.APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running", type="server_error")
        )

    async def version(self) -> VersionResponse:
        from pagellm import __version__

        return VersionResponse(version=__version__)

    async def metrics(self) -> Response:
        return Response(self.stat_logger.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> ModelList:
        root = self.llm.config.model or self.names[0]
        cards = [ModelCard(id=n, root=root, max_model_len=self.llm.max_model_len) for n in self.names]
        cards += [
            ModelCard(id=name, root=root, parent=self.names[0], max_model_len=self.llm.max_model_len)
            for name in self.loras
        ]
        return ModelList(data=cards)

    def register_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as model `name` (its config is checked now: ValueError if bad)."""
        if not self.llm.config.enable_lora:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        if name in self.loras or name in self.names:
            raise ValueError(f"a model named {name!r} is already served")
        load_adapter(path, self.llm.config.max_lora_rank)
        self.loras[name] = LoRARequest(name, next(self._lora_ids), path)
        return self.loras[name]

    async def load_lora_adapter(self, body: LoadLoRARequest) -> Response:
        try:
            await asyncio.to_thread(self.register_lora, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise errors.bad_request(str(exc), "lora_name" if "already" in str(exc) else "lora_path") from exc
        return PlainTextResponse(f"loaded LoRA adapter {body.lora_name}")

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> Response:
        if self.loras.pop(body.lora_name, None) is None:
            raise errors.model_not_found(body.lora_name)
        return PlainTextResponse(f"unloaded LoRA adapter {body.lora_name}")

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self._model(request.model)
        if request.messages is not None:
            tokens = await asyncio.to_thread(
                self._chat_prompt_ids, request.messages, None, request.add_generation_prompt
            )
        elif request.prompt is not None:
            tokens = await asyncio.to_thread(
                self.tokenizer.encode, request.prompt, add_special_tokens=request.add_special_tokens
            )
        else:
            raise errors.bad_request("give either prompt or messages", "prompt")
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.llm.max_model_len)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._model(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise errors.bad_request(
                f"token id {bad[0]} is out of range for the vocabulary of {vocab}", "tokens"
            )
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, request.tokens))

    # -- embeddings -------------------------------------------------------------------------------------

    async def embeddings(self, request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        """OpenAI's embeddings: one engine request per input, pooled by the engine (--runner pooling)."""
        model = self._model(request.model)
        if self.llm.config.runner != "pooling":
            raise errors.bad_request(
                "this server generates text; embeddings need a model served with --runner pooling", "model"
            )
        prompts = await asyncio.to_thread(self._tokenize_prompts, request.inputs())
        if not prompts:
            raise errors.bad_request("input is empty; give a string, a list of strings or token ids", "input")
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise errors.bad_request(
                f"input has {len(prompts)} items; send at most {MAX_EMBEDDING_INPUTS} at once", "input"
            )
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        request_id = f"embd-{uuid.uuid4().hex}"
        lora = self.loras.get(model)
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids}
                streams.append(await self.llm.add_request(prompt, params, rid, request.priority, lora))
        except BaseException as exc:
            _abort_all(streams)
            if isinstance(exc, ValueError):
                field = str(exc).split(":", 1)[0]
                raise errors.bad_request(str(exc), field if field == "dimensions" else "input") from exc
            raise
        if self.log_requests:
            logger.info("request %s: %d inputs, %s", request_id, len(prompts), params)
        finals = await self._final_outputs(streams, raw_request)
        data = [
            EmbeddingData(index=i, embedding=_encode_embedding(o.outputs.embedding, request.encoding_format))
            for i, o in enumerate(finals)
        ]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)

    # -- completions ------------------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw_request: Request) -> Any:
        model = self._model(request.model)
        params = self._params(request, "logprobs")
        beam = self._beam_search_params(request) if request.use_beam_search else None
        if request.suffix is not None and self._fim_ids is None:
            raise errors.bad_request(
                "suffix needs a model whose tokenizer has fill-in-the-middle tokens (such as <fim_prefix>, "
                "<fim_suffix>, <fim_middle>); this one has none",
                "suffix",
            )
        prompts = await asyncio.to_thread(self._tokenize_prompts, request.prompts(), request.suffix)
        if not prompts:
            raise errors.bad_request(
                "prompt is empty; give a string, a list of strings or token ids", "prompt"
            )
        self._check_cost(prompts, params, request.samples_field)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        lora = self.loras.get(model)
        if beam is not None:
            outputs = await self._beam_search(request, request_id, prompts, beam, lora, raw_request)
            return self._beam_search_response(request, model, request_id, prompts, outputs)
        streams = await self._add(
            request_id, prompts, params, request.priority, "prompt", lora, request.kv_transfer_params
        )
        if request.stream:
            return _sse_response(
                self._completion_events(request, model, request_id, streams, raw_request), streams
            )
        finals = await self._final_outputs(streams, raw_request)
        usage = _usage(finals)  # every sample's tokens, best_of's unanswered ones too
        choices = []
        for prompt_index, output in enumerate(finals):
            for sample in _best(output.outputs, request.n):
                choices.append(
                    self._completion_choice(request, prompt_index, output, sample, echo=request.echo)
                )
        choices.sort(key=lambda c: c.index)
        kv_transfer_params = finals[0].kv_transfer_params if len(finals) == 1 else None
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, kv_transfer_params=kv_transfer_params
        )

    def _beam_search_params(self, request: CompletionRequest) -> BeamSearchParams:
        try:
            return request.to_beam_search_params(request.max_tokens or 1)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise errors.bad_request(str(exc), "n" if field == "beam_width" else field) from exc

    async def _beam_search(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        beam: BeamSearchParams,
        lora: LoRARequest | None,
        raw_request: Request,
    ) -> list[BeamSearchOutput]:
        """use_beam_search: each step one engine request of one token per live beam (the prefix cache serves
        what the beams share); a client disconnect cancels it, aborting the step's requests."""
        longest = self.llm.max_model_len
        each = []
        for _, ids in prompts:
            max_tokens = request.max_tokens or max(longest - len(ids), 1)
            try:
                check_fits(ids, max_tokens, longest)
            except ValueError as exc:
                too_long = not ids or len(ids) >= longest or request.max_tokens is None
                raise errors.bad_request(str(exc), "prompt" if too_long else "max_tokens") from exc
            each.append(dataclasses.replace(beam, max_tokens=max_tokens))
        if self.log_requests:
            logger.info(
                "request %s: beam search of %d beams, %d prompts", request_id, beam.beam_width, len(prompts)
            )
        step = async_llm_step(self.llm, request_id, request.priority, lora, request.logprobs or 0)
        search = asyncio.create_task(
            beam_search_async(
                [ids for _, ids in prompts], each, self.llm.facts.eos_token_ids, step, self.tokenizer
            )
        )
        disconnect = asyncio.create_task(_disconnected(raw_request))
        try:
            await asyncio.wait({search, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not search.done():
                raise errors.APIError(CLIENT_CLOSED_REQUEST, "the client disconnected before the response")
            return search.result()
        except ValueError as exc:  # what the engine refused in a prompt (a token id out of range, ...)
            field = str(exc).split(" ", 1)[0]
            raise errors.bad_request(str(exc), "n" if field == "beam_width" else "prompt") from exc
        finally:
            search.cancel()
            disconnect.cancel()

    def _beam_search_response(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        results: list[BeamSearchOutput],
    ) -> CompletionResponse:
        """n choices per prompt, best beam first; usage counts the answered beams' tokens."""
        finals, choices = [], []
        for prompt_index, ((text, ids), result) in enumerate(zip(prompts, results, strict=True)):
            samples = [
                CompletionOutput(
                    index=rank,
                    text=seq.text or "",
                    token_ids=seq.output_token_ids,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
                for rank, seq in enumerate(result.sequences)
            ]
            output = RequestOutput(f"{request_id}-{prompt_index}", text, ids, samples, finished=True)
            finals.append(output)
            choices += [
                self._completion_choice(request, prompt_index, output, sample, echo=request.echo)
                for sample in samples
            ]
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(finals))

    def _completion_choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        output: RequestOutput,
        sample: CompletionOutput,
        echo: bool,
    ) -> CompletionChoice:
        text, logprobs = sample.text, None
        if request.logprobs is not None:
            token_ids, entries = sample.token_ids, sample.logprobs or []
            if echo:
                token_ids = output.prompt_token_ids + token_ids
                entries = (output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + entries
            logprobs = self._completion_logprobs(token_ids, entries, request.logprobs)
        if echo:
            text = self._prompt_text(output) + text
        return CompletionChoice(
            index=prompt_index * request.n + sample.index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    async def _completion_events(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        streams: list[RequestStream],
        raw_request: Request,
        tool_parser: Any = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        counts = _UsageCounter(len(streams))
        try:
            async with contextlib.aclosing(self._merged(streams, raw_request)) as merged:
                async for prompt_index, output in merged:
                    counts.add(prompt_index, output)
                    for sample in output.outputs:
                        index = prompt_index * request.n + sample.index
                        if index in finished or not (sample.text or sample.token_ids or sample.finish_reason):
                            continue
                        echo = request.echo and index not in echoed
                        echoed.add(index)
                        choice = self._completion_choice(request, prompt_index, output, sample, echo)
                        if choice.logprobs is not None:
                            start = offsets.get(index, 0)
                            choice.logprobs.text_offset = [start + o for o in choice.logprobs.text_offset]
                            offsets[index] = start + len(choice.text)
                        if sample.finish_reason is not None:
                            finished.add(index)
                        yield _sse(
                            CompletionChunk(id=request_id, created=created, model=model, choices=[choice])
                        )
        except Exception as exc:
            yield _error_event(exc)
        if request.include_usage:
            yield _sse(
                CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=counts.usage())
            )
        yield "data: [DONE]\n\n"

    # -- chat completions -------------------------------------------------------------------------------

    async def chat_completions(self, request: ChatCompletionRequest, raw_request: Request) -> Any:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model, tool_parser, _, streams = await self._start_chat(request, request_id)
        if request.stream:
            events = self._chat_events(request, model, request_id, streams, raw_request, tool_parser)
            return _sse_response(events, streams)
        (output,) = await self._final_outputs(streams, raw_request)
        choices = []
        for sample in output.outputs:
            message = self._message(sample.text, tool_parser, f"{request_id}-{sample.index}")
            choices.append(
                ChatChoice(
                    index=sample.index,
                    message=message,
                    logprobs=self._chat_logprobs(sample, request.top_logprobs or 0)
                    if request.logprobs
                    else None,
                    finish_reason=_finish_reason(sample.finish_reason, message.tool_calls, request),
                    stop_reason=sample.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=_usage([output]),
            kv_transfer_params=output.kv_transfer_params,
        )

    async def _chat_events(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        streams: list[RequestStream],
        raw_request: Request,
        tool_parser: Any = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, **fields: Any) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, **fields)
            return _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

        for index in range(request.n):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        finished: set[int] = set()
        splitters = {i: ReasoningStream(self.reasoning) for i in range(request.n)} if self.reasoning else {}
        tool_streams = (
            {i: ToolCallStream(tool_parser, f"{request_id}-{i}") for i in range(request.n)}
            if tool_parser
            else {}
        )
        called: set[int] = set()
        counts = _UsageCounter(1)
        try:
            async with contextlib.aclosing(self._merged(streams, raw_request)) as merged:
                async for _, output in merged:
                    counts.add(0, output)
                    for sample in output.outputs:
                        if sample.index in finished:
                            continue
                        delta = DeltaMessage(content=sample.text)
                        final = sample.finish_reason is not None
                        if splitters:  # the same split as a whole reply's, piece by piece
                            reasoning, content = splitters[sample.index].feed(sample.text, final)
                            delta = DeltaMessage(content=content or None, reasoning=reasoning or None)
                        if tool_streams:  # calls in the answer, piece by piece
                            content, calls = tool_streams[sample.index].feed(delta.content or "", final)
                            delta.content, delta.tool_calls = content or None, calls or None
                            if calls:
                                called.add(sample.index)
                        if (
                            delta.content
                            or delta.reasoning
                            or delta.tool_calls
                            or (request.logprobs and sample.token_ids)
                        ):
                            logprobs = (
                                self._chat_logprobs(sample, request.top_logprobs or 0)
                                if request.logprobs
                                else None
                            )
                            yield chunk(sample.index, delta, logprobs=logprobs)
                        if sample.finish_reason is not None:
                            finished.add(sample.index)
                            made = [{}] if sample.index in called else []
                            reason = _finish_reason(sample.finish_reason, made, request)
                            yield chunk(sample.index, DeltaMessage(), finish_reason=reason)
        except Exception as exc:
            yield _error_event(exc)
        if request.include_usage:
            usage = counts.usage()
            yield _sse(
                ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
            )
        yield "data: [DONE]\n\n"

    async def _start_chat(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[str, Any, list[int], list[RequestStream]]:
        """What a chat request does before it answers (shared with Anthropic's /v1/messages): the model, the
        sampling params, the tool parser, the rendered prompt, the cost check, the engine request. Returns
        (model, tool parser, prompt token ids, streams)."""
        model = self._model(request.model)
        params = self._params(request, "top_logprobs")
        tool_parser = self._request_tool_parser(request)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        ids = await asyncio.to_thread(
            self._chat_prompt_ids,
            request.messages,
            request.chat_template,
            request.add_generation_prompt,
            tools,
        )
        prompts: list[tuple[str | None, list[int]]] = [(None, ids)]
        self._check_cost(prompts, params)
        lora = self.loras.get(model)
        streams = await self._add(
            request_id, prompts, params, request.priority, "messages", lora, request.kv_transfer_params
        )
        return model, tool_parser, ids, streams

    def _message(self, text: str, tool_parser: Any = None, call_prefix: str = "") -> ChatResponseMessage:
        """A whole reply: split into reasoning and content when a reasoning parser is set, and its tool
        calls parsed out of the content when the request may call tools."""
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else ("", text)
        calls = []
        if tool_parser is not None:
            parsed = tool_parser.parse(content, final=True)
            content = parsed.content
            calls = [
                ToolCall(id=call_id(call_prefix, i), function=ToolCallFunction(name=name, arguments=args))
                for i, (name, args) in enumerate(parsed.calls)
            ]
        return ChatResponseMessage(
            content=content if content or not (reasoning or calls) else None,
            reasoning=reasoning or None,
            tool_calls=calls,
        )

    def _request_tool_parser(self, request: ChatCompletionRequest) -> Any:
        """What finds this request's tool calls: the server's parser (auto), or the format the grammar
        imposed (required, a named function); None when it may not call tools."""
        choice = request.effective_tool_choice
        if choice == "none" or not request.tools:
            return None
        if choice == "required":
            return RequiredToolParser()
        if isinstance(choice, NamedToolChoice):
            return NamedToolParser(choice.function.name)
        if not self.enable_auto_tool_choice or self.tool_parser is None:
            raise errors.bad_request(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                '--tool-call-parser; or set tool_choice to "none", "required" or a function',
                "tool_choice",
            )
        return self.tool_parser

    def _chat_prompt_ids(
        self,
        messages: list[ChatMessage],
        template: str | None,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
    ) -> list[int]:
        template = template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request(
                "this model has no chat template; start the server with --chat-template FILE", "messages"
            )
        conversation = [_message_dict(m) for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                tools=tools,
            )
        except Exception as exc:
            raise errors.bad_request(
                f"the chat template could not render these messages: {exc}", "messages"
            ) from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # -- shared machinery -------------------------------------------------------------------------------

    def _model(self, name: str | None) -> str:
        if name is None:
            return self.names[0]
        if name not in self.names and name not in self.loras:
            raise errors.model_not_found(name)
        return name

    def _params(
        self, request: CompletionRequest | ChatCompletionRequest, logprobs_field: str
    ) -> SamplingParams:
        if self.llm.config.runner == "pooling":
            raise errors.bad_request(
                "this server computes embeddings (--runner pooling): use /v1/embeddings, or serve the model "
                "with --runner generate to generate text",
                "model",
            )
        try:
            params = request.to_sampling_params(self.llm.default_sampling_params())
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            param = logprobs_field if field == "logprobs" else field
            raise errors.bad_request(
                str(exc), param if param in type(request).model_fields else None
            ) from exc
        if params.n > self.max_n:
            field = getattr(request, "samples_field", "n")
            raise errors.bad_request(
                f"{field} must be <= {self.max_n} (this server's --max-n), got {params.n}", field
            )
        return params

    def _check_cost(
        self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, samples_field: str = "n"
    ) -> None:
        """Refuse a request whose samples, each at its longest (prompt + max_tokens, at most max_model_len),
        cannot all be in the KV cache at once: no single request may take the whole engine over."""
        longest = self.llm.max_model_len
        per_prompt = [
            longest if params.max_tokens is None else min(len(ids) + params.max_tokens, longest)
            for _, ids in prompts
        ]
        tokens, capacity = params.n * sum(per_prompt), self.llm.kv_cache_tokens
        if tokens > capacity:
            raise errors.bad_request(
                f"this request's {params.n * len(prompts)} samples may reach {tokens} tokens together "
                f"(n x (prompt + max_tokens), summed over the prompts), more than the {capacity} tokens the "
                f"server's KV cache holds; lower {samples_field} or max_tokens, or send fewer prompts at once",
                samples_field if params.n > 1 else "prompt",
            )

    def _tokenize_prompts(
        self, prompts: list[str | list[int]], suffix: str | None = None
    ) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt; slow for long texts, so the caller runs it in a thread. With a
        suffix, each becomes a fill-in-the-middle prompt: prefix token, prompt, suffix token, suffix,
        middle token (after the BOS a text prompt would start with)."""
        if suffix is None:
            return [
                (p, self.tokenizer.encode(p, add_special_tokens=True))
                if isinstance(p, str)
                else (None, list(p))
                for p in prompts
            ]
        assert self._fim_ids is not None
        pre, suf, mid = self._fim_ids
        bos = self.tokenizer.encode("", add_special_tokens=True)[:1]
        bos = bos if bos and bos[0] == self.tokenizer.bos_token_id else []
        tail = [suf, *self.tokenizer.encode(suffix, add_special_tokens=False), mid]
        return [
            (p, [*bos, pre, *self.tokenizer.encode(p, add_special_tokens=False), *tail])
            if isinstance(p, str)
            else (None, [pre, *p, *tail])
            for p in prompts
        ]

    @functools.cached_property
    def _fim_ids(self) -> tuple[int, int, int] | None:
        return fim_token_ids(self.tokenizer)

    async def _add(
        self,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        priority: int,
        prompt_field: str,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt; on any invalid prompt, abort those added and answer 400.
        `kv_transfer_params` go to the engine's KV connector with the (one) prompt."""
        if kv_transfer_params is not None and len(prompts) > 1:
            raise errors.bad_request(
                "kv_transfer_params go with one prompt, not several", "kv_transfer_params"
            )
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids}
                if kv_transfer_params is not None:
                    prompt["kv_transfer_params"] = kv_transfer_params
                streams.append(await self.llm.add_request(prompt, params, rid, priority, lora_request))
                if self.log_requests:
                    logger.info("request %s: %d prompt tokens, %s", rid, len(ids), params)
        except BaseException as exc:
            _abort_all(streams)
            if isinstance(exc, PromptTooLongError):
                too_long = len(ids) >= self.llm.max_model_len or params.max_tokens is None
                raise errors.bad_request(str(exc), prompt_field if too_long else "max_tokens") from exc
            if isinstance(exc, ValueError):
                field = str(exc).split(" ", 1)[0]
                raise errors.bad_request(
                    str(exc), field if field in ("stop_token_ids", "logit_bias") else prompt_field
                ) from exc
            raise
        return streams

    async def _merged(
        self, streams: list[RequestStream], raw_request: Request
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they come. A client disconnect, an error or leaving
        early aborts every stream (freeing its KV blocks)."""
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await merged.put((index, output))
                await merged.put((index, None))
            except Exception as exc:
                await merged.put((index, exc))

        async def watch_disconnect() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass
            _abort_all(streams)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        tasks.append(asyncio.create_task(watch_disconnect()))
        try:
            remaining = len(streams)
            while remaining:
                index, item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            _abort_all(streams)
            for task in tasks:
                task.cancel()

    async def _final_outputs(self, streams: list[RequestStream], raw_request: Request) -> list[RequestOutput]:
        finals: list[Any] = [None] * len(streams)
        async with contextlib.aclosing(self._merged(streams, raw_request)) as merged:
            async for index, output in merged:
                finals[index] = output
        if not all(o is not None and o.finished for o in finals):  # aborted: its client disconnected
            raise errors.APIError(CLIENT_CLOSED_REQUEST, "the client disconnected before the response")
        return finals

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _token_text(self, token_id: int, entry: dict[int, Logprob] | None) -> str:
        if entry and token_id in entry and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = self._token_text(token_id, entry)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(entry[token_id].logprob, _MIN_LOGPROB))
            top = {self._token_text(t, entry): max(lp.logprob, _MIN_LOGPROB) for t, lp in _top(entry, k)}
            top.setdefault(token, out.token_logprobs[-1])
            out.top_logprobs.append(top)
        return out

    def _chat_logprobs(self, sample: CompletionOutput, k: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=False):
            token = self._token_text(token_id, entry)
            tops = [
                TopLogprob(token=text, logprob=max(lp.logprob, _MIN_LOGPROB), bytes=list(text.encode()))
                for text, lp in ((self._token_text(t, entry), lp) for t, lp in _top(entry, k))
            ]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=max(entry[token_id].logprob, _MIN_LOGPROB),
                    bytes=list(token.encode()),
                    top_logprobs=tops,
                )
            )
        return ChatLogprobs(content=content)


class _UsageCounter:
    """Token counts of a streamed request, from delta outputs."""

    def __init__(self, num_prompts: int):
        self.prompt_tokens = [0] * num_prompts
        self.completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.completion_tokens += sum(len(s.token_ids) for s in output.outputs)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
        )


async def _disconnected(raw_request: Request) -> None:
    """Return once the client has disconnected."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def _sse_response(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """Server-sent events that abort their requests however the stream ends: closed mid-way, or cancelled by
    a disconnect before it started (the background task runs after the response, whatever happened)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            _abort_all(streams)

    return StreamingResponse(
        guarded(), media_type="text/event-stream", background=BackgroundTask(_abort_all, streams)
    )


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


def _usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, base64-encoded (as OpenAI sends them)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) fill-in-the-middle token ids, in the spelling this tokenizer's vocabulary
    has; None when it has none of them."""
    vocab = tokenizer.get_vocab()
    for spelling in FIM_TOKENS:
        if all(t in vocab for t in spelling):
            return vocab[spelling[0]], vocab[spelling[1]], vocab[spelling[2]]
    return None


def _best(samples: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples with the highest cumulative logprob, renumbered 0..n-1 (all when there are
    only n)."""
    if len(samples) <= n:
        return samples
    ranked = sorted(samples, key=_cumulative_logprob, reverse=True)[:n]
    return [dataclasses.replace(s, index=i) for i, s in enumerate(ranked)]


def _cumulative_logprob(sample: CompletionOutput) -> float:
    entries = sample.logprobs or []
    return sum(e[t].logprob for t, e in zip(sample.token_ids, entries, strict=False) if e and t in e)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank,
    )
    return ranked[:k]


def _tool_parser(name: str | None) -> Any:
    """An instance of --tool-call-parser NAME (from the plugins' registry), or None."""
    if name is None:
        return None
    registry = load_plugins()
    parser = registry.tool_parsers.get(name)
    if parser is None:
        known = ", ".join(sorted(registry.tool_parsers)) or "none installed"
        raise ValueError(f"--tool-call-parser {name}: no such tool-call parser; known: {known}")
    return parser()


def _finish_reason(reason: str | None, calls: list, request: ChatCompletionRequest) -> str | None:
    """OpenAI's: "tool_calls" when a reply that stopped by itself called tools (not for a named function)."""
    if reason == "stop" and calls and not isinstance(request.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


def _reasoning_parser(llm: AsyncLLM) -> Any:
    """An instance of the engine's --reasoning-parser (from the plugins' registry), or None."""
    parser = reasoning_parser(load_plugins(), llm.config.reasoning_parser)
    return parser() if parser is not None else None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise errors.bad_request(
                    f"content parts of type {part.get('type')!r} are not supported; send text", "messages"
                )
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    out = {**(message.model_extra or {}), "role": message.role, "content": content or ""}
    if "reasoning" in out and "reasoning_content" not in out:  # chat templates read reasoning_content
        out["reasoning_content"] = out["reasoning"]
    for call in out.get("tool_calls") or []:  # OpenAI sends arguments as JSON text; templates want objects
        function = call.get("function", {}) if isinstance(call, dict) else {}
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
    if message.name is not None:
        out["name"] = message.name
    return out


def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _error_event(exc: Exception) -> str:
    """A stream that already answered 200 reports a later failure as an OpenAI error event."""
    return _sse(ErrorResponse(error=errors.from_exception(exc).info))
