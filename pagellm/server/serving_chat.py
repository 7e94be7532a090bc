"""OpenAI's chat completions (`POST /v1/chat/completions`, vLLM's `serving_chat.py`): messages rendered by
the chat template, replies split into reasoning and content by `--reasoning-parser`, tool calls found by
`--tool-call-parser` (tool_choice auto) or by the format a grammar imposed (required, a named function:
bare JSON, or for GPT-OSS a whole harmony reply), streamed or whole. Anthropic's Messages API (anthropic.py) serves its requests through `start_chat` and
`message`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from pagellm.core.parsers import ReasoningParser, ToolParser, reads_special_tokens, reads_whole_reply
from pagellm.engine.async_llm import AsyncLLM, RequestStream
from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.engine.setup import reasoning_parser
from pagellm.plugins.loader import load_plugins
from pagellm.sampling.params import SamplingParams, StructuredOutputsParams
from pagellm.server import errors, harmony
from pagellm.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    NamedToolChoice,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
    UsageInfo,
)
from pagellm.server.reasoning import GptOssReasoningParser, ReasoningStream
from pagellm.server.serving_base import (
    MIN_LOGPROB,
    Prompts,
    ServingBase,
    final_outputs,
    openai_events,
    sse_response,
    top_logprobs,
    usage_of,
)
from pagellm.server.serving_models import ServedModels
from pagellm.server.tool_parsers import (
    NamedToolParser,
    OpenAIToolParser,
    RequiredToolParser,
    ToolCallStream,
    call_id,
)


class ServingChat(ServingBase):
    def __init__(
        self,
        llm: AsyncLLM,
        models: ServedModels,
        *,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        **options: Any,
    ):
        """`tool_call_parser`: --tool-call-parser, for tool_choice auto (ValueError for an unknown name);
        `options` are `ServingBase`'s."""
        super().__init__(llm, models, **options)
        self.reasoning: ReasoningParser | None = _reasoning_parser(llm)
        self.tool_parser: ToolParser | None = tool_parser(tool_call_parser)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # GPT-OSS: its replies are harmony messages, forced calls included
        self.speaks_harmony = isinstance(self.reasoning, GptOssReasoningParser) or isinstance(
            self.tool_parser, OpenAIToolParser
        )

    async def chat_completions(self, request: ChatCompletionRequest, raw_request: Request) -> Any:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model, tool_parser, _, streams = await self.start_chat(request, request_id)
        if request.stream:
            events = self._events(request, model, request_id, streams, raw_request, tool_parser)
            return sse_response(events, streams)
        (output,) = await final_outputs(streams, raw_request)
        choices = []
        for sample in output.outputs:
            message = self.message(sample.text, tool_parser, f"{request_id}-{sample.index}")
            choices.append(
                ChatChoice(
                    index=sample.index,
                    message=message,
                    logprobs=self._logprobs(sample, request.top_logprobs or 0) if request.logprobs else None,
                    finish_reason=_finish_reason(sample.finish_reason, message.tool_calls, request),
                    stop_reason=sample.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of([output]),
            kv_transfer_params=output.kv_transfer_params,
        )

    async def start_chat(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[str, ToolParser | None, list[int], list[RequestStream]]:
        """What a chat request does before it answers (Anthropic's /v1/messages too): the model, the
        sampling params, the tool parser, the rendered prompt, the cost check, the engine request. Returns
        (model, tool parser, prompt token ids, streams)."""
        model = self.served.resolve(request.model)
        params = self.sampling_params(request, "top_logprobs")
        tool_parser = self._request_tool_parser(request)
        if self.speaks_harmony and isinstance(tool_parser, (RequiredToolParser, NamedToolParser)):
            tool_parser = self._harmony_forced_calls(request, params)
        if reads_special_tokens(self.reasoning) or reads_special_tokens(tool_parser):
            # the parsers read the markers (special tokens) and leave them out of what they return
            params.skip_special_tokens = False
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        images = await self.chat_images(request.messages)
        if images:
            text, ids = await asyncio.to_thread(
                self.chat_prompt_text,
                request.messages,
                request.chat_template,
                request.add_generation_prompt,
                tools,
                request.chat_template_kwargs,
            )
            prompts: Prompts = [(text, ids)]
        else:
            ids = await asyncio.to_thread(
                self.chat_prompt_ids,
                request.messages,
                request.chat_template,
                request.add_generation_prompt,
                tools,
                request.chat_template_kwargs,
            )
            prompts = [(None, ids)]
        self.check_cost(prompts, params)
        lora = self.served.lora(model)
        streams = await self.add_requests(
            request_id,
            prompts,
            params,
            request.priority,
            "messages",
            lora,
            request.kv_transfer_params,
            images=images,
        )
        return model, tool_parser, ids, streams

    def message(
        self, text: str, tool_parser: ToolParser | None = None, call_prefix: str = ""
    ) -> ChatResponseMessage:
        """A whole reply: split into reasoning and content when a reasoning parser is set, and its tool
        calls parsed out of the content (or the whole reply, for a parser that reads it) when the request
        may call tools."""
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else ("", text)
        calls = []
        if tool_parser is not None:
            parsed = tool_parser.parse(text if reads_whole_reply(tool_parser) else content, final=True)
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

    def _request_tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
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

    def _harmony_forced_calls(self, request: ChatCompletionRequest, params: SamplingParams) -> ToolParser:
        """A harmony model that must call (tool_choice required or a named function): the grammar is a whole
        harmony reply, its thinking and then the calls as commentary messages, rather than bare JSON (which
        would leave no room to think, in a format the model was not trained on); the calls are read from
        it as with tool_choice auto."""
        choice = request.effective_tool_choice
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        functions = [t.function.model_dump() for t in request.tools or []]
        tag = harmony.forced_calls_tag(functions, only, request.parallel_tool_calls)
        params.structured_outputs = StructuredOutputsParams(structural_tag=tag)
        return OpenAIToolParser()

    def _events(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        streams: list[RequestStream],
        raw_request: Request,
        tool_parser: ToolParser | None,
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(index: int, delta: DeltaMessage, **fields: Any) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index=index, delta=delta, **fields)
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        finished: set[int] = set()
        replies = (
            {i: ReplyStream(self.reasoning, tool_parser, f"{request_id}-{i}") for i in range(request.n)}
            if self.reasoning or tool_parser
            else {}
        )
        called: set[int] = set()

        def chunks(_: int, output: RequestOutput) -> Iterator[ChatCompletionChunk]:
            for sample in output.outputs:
                if sample.index in finished:
                    continue
                delta = DeltaMessage(content=sample.text)
                final = sample.finish_reason is not None
                if replies:  # the same split and calls as a whole reply's, piece by piece
                    reasoning, content, calls = replies[sample.index].feed(sample.text, final)
                    delta = DeltaMessage(
                        content=content or None, reasoning=reasoning or None, tool_calls=calls or None
                    )
                    if calls:
                        called.add(sample.index)
                if (
                    delta.content
                    or delta.reasoning
                    or delta.tool_calls
                    or (request.logprobs and sample.token_ids)
                ):
                    logprobs = self._logprobs(sample, request.top_logprobs or 0) if request.logprobs else None
                    yield chunk(sample.index, delta, logprobs=logprobs)
                if sample.finish_reason is not None:
                    finished.add(sample.index)
                    made = [{}] if sample.index in called else []
                    reason = _finish_reason(sample.finish_reason, made, request)
                    yield chunk(sample.index, DeltaMessage(), finish_reason=reason)

        def usage_chunk(usage: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)

        opening = [chunk(index, DeltaMessage(role="assistant", content="")) for index in range(request.n)]
        usage = usage_chunk if request.include_usage else None
        return openai_events(streams, raw_request, chunks, usage, opening)

    def _logprobs(self, sample: CompletionOutput, k: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(sample.token_ids, sample.logprobs or [], strict=False):
            token = self.token_text(token_id, entry)
            tops = [
                TopLogprob(token=text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=list(text.encode()))
                for text, lp in ((self.token_text(t, entry), lp) for t, lp in top_logprobs(entry, k))
            ]
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=max(entry[token_id].logprob, MIN_LOGPROB),
                    bytes=list(token.encode()),
                    top_logprobs=tops,
                )
            )
        return ChatLogprobs(content=content)


class ReplyStream:
    """One streamed reply through the reasoning parser and the tool-call parser, as `ServingChat.message`
    parses a whole one: feed it each text delta, get (reasoning delta, content delta, tool-call deltas)."""

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolParser | None, call_prefix: str):
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        self.calls = ToolCallStream(tool_parser, call_prefix) if tool_parser else None
        self.whole_reply = reads_whole_reply(tool_parser)

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[dict]]:
        reasoning, content = self.reasoning.feed(delta, final) if self.reasoning else ("", delta)
        if self.calls is None:
            return reasoning, content, []
        content, calls = self.calls.feed(delta if self.whole_reply else content, final)
        return reasoning, content, calls


def tool_parser(name: str | None) -> ToolParser | None:
    """An instance of --tool-call-parser NAME (from the plugins' registry), or None."""
    if name is None:
        return None
    registry = load_plugins()
    parser = registry.tool_parsers.get(name)
    if parser is None:
        known = ", ".join(sorted(registry.tool_parsers)) or "none installed"
        raise ValueError(f"--tool-call-parser {name}: no such tool-call parser; known: {known}")
    return parser()


def _reasoning_parser(llm: AsyncLLM) -> ReasoningParser | None:
    """An instance of the engine's --reasoning-parser (from the plugins' registry), or None."""
    parser = reasoning_parser(load_plugins(), llm.config.reasoning_parser)
    return parser() if parser is not None else None


def _finish_reason(reason: str | None, calls: list, request: ChatCompletionRequest) -> str | None:
    """OpenAI's: "tool_calls" when a reply that stopped by itself called tools (not for a named function)."""
    if reason == "stop" and calls and not isinstance(request.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason
