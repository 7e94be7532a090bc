"""What every API family's serving module shares (vLLM's `serving_engine.py`).

`ServingBase`, which each family's serving class extends, holds the engine, the served models
(serving_models.py) and the server's limits, and turns a request into engine requests: the model check and
adapter lookup, prompt building (chat template, fill-in-the-middle) and tokenization (callers run it in a
worker thread: a long prompt must not stall the event loop), sampling params, the cost check, and adding
the requests (400 for what the engine refuses, naming the field; `error_param` reads the field from the
engine's message). The functions below read the engine's streams: merged as they come, the final outputs,
and OpenAI's server-sent events; each aborts its requests when the client disconnects, mid-stream or
before the first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagellm.core.errors import ConfigError
from pagellm.core.pooling import PoolingParams
from pagellm.engine.async_llm import AsyncLLM, RequestStream
from pagellm.engine.outputs import Logprob, RequestOutput
from pagellm.engine.processor import check_length
from pagellm.lora.request import LoRARequest
from pagellm.multimodal import MediaError, load_image_async
from pagellm.multimodal.chat import split_images
from pagellm.multimodal.limits import media_limits
from pagellm.sampling.params import SamplingParams
from pagellm.server import errors
from pagellm.server.limits import DEFAULT_MAX_N
from pagellm.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    UsageInfo,
)
from pagellm.server.serving_models import ServedModels

logger = logging.getLogger("pagellm")

MIN_LOGPROB = -9999.0  # JSON has no -inf
CLIENT_CLOSED_REQUEST = 499  # nobody reads it; it keeps the log free of tracebacks
FIM_TOKENS = (  # fill-in-the-middle (prefix, suffix, middle) tokens, as tokenizers spell them
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)

Prompts = list[tuple[str | None, list[int]]]  # (text, token ids) of each prompt; text None for token ids


def error_param(exc: Exception) -> str | None:
    """The setting a refusal names: `ConfigError.param`, set where the check was made (None for an error
    that names none)."""
    return getattr(exc, "param", None)


class ServingBase:
    """The engine, the served models and the server's limits, and what every endpoint does with them."""

    def __init__(
        self,
        llm: AsyncLLM,
        models: ServedModels,
        *,
        chat_template: str | None = None,
        log_requests: bool = True,
        max_n: int = DEFAULT_MAX_N,
    ):
        self.llm = llm
        self.served = models  # the model names and LoRA adapters this server answers to
        self.chat_template = chat_template  # --chat-template, for models without one (or to replace it)
        self.log_requests = log_requests
        self.max_n = max_n
        self.tokenizer = llm.tokenizer
        self.media_limits = media_limits(llm.config)  # where image URLs may come from

    # -- prompts ----------------------------------------------------------------------------------------

    def tokenize_prompts(self, prompts: list[str | list[int]], suffix: str | None = None) -> Prompts:
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
        assert self.fim_ids is not None
        pre, suf, mid = self.fim_ids
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
    def fim_ids(self) -> tuple[int, int, int] | None:
        return fim_token_ids(self.tokenizer)

    def chat_prompt_ids(
        self,
        messages: list[ChatMessage],
        template: str | None,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of `messages` rendered by the chat template (the request's, else the server's, else
        the tokenizer's), with `template_kwargs` as its variables; 400 naming `messages` when there is none
        or it fails. Run it in a thread."""
        conversation = [message_dict(m) for m in messages]
        ids = self._render(conversation, template, add_generation_prompt, tools, True, template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _render(
        self,
        conversation: list[dict],
        template: str | None,
        add_generation_prompt: bool,
        tools,
        tokenize: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The chat template's output (token ids or text); 400 naming `messages` when it fails."""
        template = template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request(
                "this model has no chat template; start the server with --chat-template FILE", "messages"
            )
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                tools=tools,
                **(template_kwargs or {}),
            )
        except Exception as exc:
            raise errors.bad_request(
                f"the chat template could not render these messages: {exc}", "messages"
            ) from exc

    async def chat_images(self, messages: list[ChatMessage]) -> list[Any]:
        """The images of a conversation's `image_url` parts, fetched and decoded off the event loop, in the
        order the chat template writes their placeholders; 400 naming the part for a model that takes no
        images, one image too many, or one that cannot be read."""
        sources = []
        for i, message in enumerate(messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    sources.append((url, f"messages[{i}].content[{j}]"))
        if not sources:
            return []
        if not self.llm.takes_images:
            raise errors.bad_request("this model takes no images; send text only", sources[0][1])
        limit = self.llm.config.image_limit
        if len(sources) > limit:
            raise errors.bad_request(
                f"{len(sources)} images; this server takes at most {limit} per prompt (--limit-mm-per-prompt)",
                sources[limit][1],
            )
        for url, field in sources:
            if not isinstance(url, str) or not url:
                raise errors.bad_request("image_url needs a url", field)
        try:
            return list(
                await asyncio.gather(
                    *(load_image_async(url, self.media_limits, field_hint=field) for url, field in sources)
                )
            )
        except MediaError as exc:
            raise errors.bad_request(str(exc), exc.field_hint) from exc

    def chat_prompt_text(
        self,
        messages: list[ChatMessage],
        template: str | None,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """A conversation with images rendered by the chat template as text, each image as the model's
        placeholder, and that text's token ids (before the engine expands the placeholders to the images'
        tokens); 400 naming `messages` when it fails. Run it in a thread."""
        try:
            conversation, _ = split_images([message_dict(m, keep_images=True) for m in messages])
        except ConfigError as exc:  # a part that is neither text nor an image
            raise errors.bad_request(str(exc), exc.param) from exc
        text = self._render(conversation, template, add_generation_prompt, tools, False, template_kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    # -- checks -----------------------------------------------------------------------------------------

    def sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, logprobs_field: str
    ) -> SamplingParams:
        """The request's SamplingParams over the engine's defaults; 400 naming the field it got wrong."""
        if self.llm.config.runner == "pooling":
            raise errors.bad_request(
                "this server computes embeddings (--runner pooling): use /v1/embeddings, or serve the model "
                "with --runner generate to generate text",
                "model",
            )
        try:
            params = request.to_sampling_params(self.llm.default_sampling_params())
        except ValueError as exc:
            field = error_param(exc)
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

    def check_cost(self, prompts: Prompts, params: SamplingParams, samples_field: str = "n") -> None:
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

    # -- engine requests --------------------------------------------------------------------------------

    async def add_requests(
        self,
        request_id: str,
        prompts: Prompts,
        params: SamplingParams | PoolingParams,
        priority: int,
        prompt_field: str,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        log_each: bool = True,
        images: list[Any] | None = None,
    ) -> list[RequestStream]:
        """Add one engine request per prompt (`request_id`, or `request_id-i` of several); on any prompt the
        engine refuses, abort those added and answer 400 naming `refused_param`'s field. With `log_each`
        (and --log-requests) each is logged. `kv_transfer_params` go to the engine's KV connector with the
        (one) prompt, as do `images` (the prompt is then a chat template's text with their placeholders)."""
        if kv_transfer_params is not None and len(prompts) > 1:
            raise errors.bad_request(
                "kv_transfer_params go with one prompt, not several", "kv_transfer_params"
            )
        streams: list[RequestStream] = []
        try:
            if isinstance(params, SamplingParams):  # the engine checks it too, but only past the queue bound:
                for _, ids in prompts:  # a request that can never run gets 400, not 503 and Retry-After
                    check_length(len(ids), params.max_tokens, self.llm.max_model_len)
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
                if images:
                    prompt = {
                        "prompt": text,
                        "multi_modal_data": {"image": images},
                        "add_special_tokens": False,
                    }
                if kv_transfer_params is not None:
                    prompt["kv_transfer_params"] = kv_transfer_params
                streams.append(await self.llm.add_request(prompt, params, rid, priority, lora_request))
                if self.log_requests and log_each:
                    logger.info("request %s: %d prompt tokens, %s", rid, len(ids), params)
        except BaseException as exc:
            abort_all(streams)
            if isinstance(exc, ValueError):
                param = self.refused_param(exc, prompt_field)
                raise errors.bad_request(str(exc), param) from exc
            raise
        return streams

    def refused_param(self, exc: ValueError, prompt_field: str) -> str | None:
        """The field a prompt the engine refused answers 400 for: max_tokens (the prompt alone fits the
        context), stop_token_ids or logit_bias when the check names them; else the prompt."""
        field = error_param(exc)
        return field if field in ("max_tokens", "stop_token_ids", "logit_bias") else prompt_field

    def token_text(self, token_id: int, entry: dict[int, Logprob] | None) -> str:
        """A token as logprobs show it: its decoded text from the engine, else decoded here."""
        if entry and token_id in entry and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.tokenizer.decode([token_id])


# -- the engine's streams -------------------------------------------------------------------------------


async def merged_outputs(
    streams: list[RequestStream], raw_request: Request
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come. A client disconnect, an error or leaving early
    aborts every stream (freeing its KV blocks)."""
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
            await merged.put((index, None))
        except Exception as exc:
            await merged.put((index, exc))

    async def abort_on_disconnect() -> None:
        await disconnected(raw_request)
        abort_all(streams)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    tasks.append(asyncio.create_task(abort_on_disconnect()))
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
        abort_all(streams)
        for task in tasks:
            task.cancel()


async def final_outputs(streams: list[RequestStream], raw_request: Request) -> list[RequestOutput]:
    """Each stream's finished output, in order; 499 when the client disconnected before they finished."""
    finals: list[Any] = [None] * len(streams)
    async with contextlib.aclosing(merged_outputs(streams, raw_request)) as merged:
        async for index, output in merged:
            finals[index] = output
    if not all(o is not None and o.finished for o in finals):  # aborted: its client disconnected
        raise errors.APIError(CLIENT_CLOSED_REQUEST, "the client disconnected before the response")
    return finals


async def disconnected(raw_request: Request) -> None:
    """Return once the client has disconnected."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


class UsageCounter:
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


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Token counts of finished outputs: their prompts' and every sample's."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- server-sent events ---------------------------------------------------------------------------------


def sse_response(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """Server-sent events that abort their requests however the stream ends: closed mid-way, or cancelled by
    a disconnect before it started (the background task runs after the response, whatever happened)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            abort_all(streams)

    return StreamingResponse(
        guarded(), media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
    )


async def openai_events(
    streams: list[RequestStream],
    raw_request: Request,
    chunks: Callable[[int, RequestOutput], Iterable[BaseModel]],
    usage_chunk: Callable[[UsageInfo], BaseModel] | None = None,
    opening: Iterable[BaseModel] = (),
) -> AsyncIterator[str]:
    """An OpenAI event stream: the `opening` chunks, then `chunks(prompt index, output)` of each output as
    it comes, an error event if something fails after the 200 went out, `usage_chunk` of the token counts
    (when the request asked for usage), and `[DONE]`."""
    for body in opening:
        yield sse(body)
    counts = UsageCounter(len(streams))
    try:
        async with contextlib.aclosing(merged_outputs(streams, raw_request)) as merged:
            async for prompt_index, output in merged:
                counts.add(prompt_index, output)
                for body in chunks(prompt_index, output):
                    yield sse(body)
    except Exception as exc:
        yield error_event(exc)
    if usage_chunk is not None:
        yield sse(usage_chunk(counts.usage()))
    yield "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def error_event(exc: Exception) -> str:
    """A stream that already answered 200 reports a later failure as an OpenAI error event."""
    return sse(ErrorResponse(error=errors.from_exception(exc).info))


# -- helpers --------------------------------------------------------------------------------------------


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) fill-in-the-middle token ids, in the spelling this tokenizer's vocabulary
    has; None when it has none of them."""
    vocab = tokenizer.get_vocab()
    for spelling in FIM_TOKENS:
        if all(t in vocab for t in spelling):
            return vocab[spelling[0]], vocab[spelling[1]], vocab[spelling[2]]
    return None


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best-ranked (token id, logprob) of one position, best first."""
    ranked = sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
        key=lambda item: item[1].rank,
    )
    return ranked[:k]


def message_dict(message: ChatMessage, keep_images: bool = False) -> dict[str, Any]:
    """A chat message as chat templates read it: text parts joined (400 for other parts; with
    `keep_images`, the parts are kept for `split_images`), reasoning as `reasoning_content` and `thinking`,
    tool-call arguments as objects."""
    content = message.content
    if isinstance(content, list) and not keep_images:
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise errors.bad_request(
                    f"content parts of type {part.get('type')!r} are not supported; send text", "messages"
                )
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    out = {**(message.model_extra or {}), "role": message.role, "content": content or ""}
    reasoning = out.get("reasoning_content", out.get("reasoning"))
    if reasoning is not None:  # chat templates read reasoning_content (Qwen3, DeepSeek) or thinking (GPT-OSS)
        out.setdefault("reasoning_content", reasoning)
        out.setdefault("thinking", reasoning)
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
