"""OpenAI's completions (`POST /v1/completions`, vLLM's `serving_completion.py`): prompts as text or token
ids, several at once, `n` and `best_of` samples, echo, fill-in-the-middle `suffix`, logprobs, beam search
(`use_beam_search`), streamed or whole."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from pagellm.engine.async_llm import RequestStream
from pagellm.engine.beam_search import BeamSearchOutput, async_llm_step, beam_search_async, check_fits
from pagellm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import BeamSearchParams
from pagellm.server import errors
from pagellm.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagellm.server.serving_base import (
    CLIENT_CLOSED_REQUEST,
    MIN_LOGPROB,
    Prompts,
    ServingBase,
    disconnected,
    error_param,
    final_outputs,
    openai_events,
    sse_response,
    top_logprobs,
    usage_of,
)

logger = logging.getLogger("pagellm")


class ServingCompletion(ServingBase):
    async def completions(self, request: CompletionRequest, raw_request: Request) -> Any:
        model = self.served.resolve(request.model)
        params = self.sampling_params(request, "logprobs")
        beam = self._beam_search_params(request) if request.use_beam_search else None
        if request.suffix is not None and self.fim_ids is None:
            raise errors.bad_request(
                "suffix needs a model whose tokenizer has fill-in-the-middle tokens (such as <fim_prefix>, "
                "<fim_suffix>, <fim_middle>); this one has none",
                "suffix",
            )
        prompts = await asyncio.to_thread(self.tokenize_prompts, request.prompts(), request.suffix)
        if not prompts:
            raise errors.bad_request(
                "prompt is empty; give a string, a list of strings or token ids", "prompt"
            )
        self.check_cost(prompts, params, request.samples_field)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        lora = self.served.lora(model)
        if beam is not None:
            outputs = await self._beam_search(request, request_id, prompts, beam, lora, raw_request)
            return self._beam_search_response(request, model, request_id, prompts, outputs)
        streams = await self.add_requests(
            request_id, prompts, params, request.priority, "prompt", lora, request.kv_transfer_params
        )
        if request.stream:
            return sse_response(self._events(request, model, request_id, streams, raw_request), streams)
        finals = await final_outputs(streams, raw_request)
        usage = usage_of(finals)  # every sample's tokens, best_of's unanswered ones too
        choices = []
        for prompt_index, output in enumerate(finals):
            for sample in _best(output.outputs, request.n):
                choices.append(self._choice(request, prompt_index, output, sample, echo=request.echo))
        choices.sort(key=lambda c: c.index)
        kv_transfer_params = finals[0].kv_transfer_params if len(finals) == 1 else None
        return CompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, kv_transfer_params=kv_transfer_params
        )

    def _beam_search_params(self, request: CompletionRequest) -> BeamSearchParams:
        try:
            return request.to_beam_search_params(request.max_tokens or 1)
        except ValueError as exc:
            field = error_param(exc)
            raise errors.bad_request(str(exc), "n" if field == "beam_width" else field) from exc

    async def _beam_search(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: Prompts,
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
        disconnect = asyncio.create_task(disconnected(raw_request))
        try:
            await asyncio.wait({search, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not search.done():
                raise errors.APIError(CLIENT_CLOSED_REQUEST, "the client disconnected before the response")
            return search.result()
        except ValueError as exc:  # what the engine refused in a prompt (a token id out of range, ...)
            field = error_param(exc)
            raise errors.bad_request(str(exc), "n" if field == "beam_width" else "prompt") from exc
        finally:
            search.cancel()
            disconnect.cancel()

    def _beam_search_response(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: Prompts,
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
                self._choice(request, prompt_index, output, sample, echo=request.echo) for sample in samples
            ]
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of(finals))

    def _choice(
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
            logprobs = self._logprobs(token_ids, entries, request.logprobs)
        if echo:
            text = self._prompt_text(output) + text
        return CompletionChoice(
            index=prompt_index * request.n + sample.index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _events(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        streams: list[RequestStream],
        raw_request: Request,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        finished: set[int] = set()
        offsets: dict[int, int] = {}

        def chunks(prompt_index: int, output: RequestOutput) -> Iterator[CompletionChunk]:
            for sample in output.outputs:
                index = prompt_index * request.n + sample.index
                if index in finished or not (sample.text or sample.token_ids or sample.finish_reason):
                    continue
                echo = request.echo and index not in echoed
                echoed.add(index)
                choice = self._choice(request, prompt_index, output, sample, echo)
                if choice.logprobs is not None:
                    start = offsets.get(index, 0)
                    choice.logprobs.text_offset = [start + o for o in choice.logprobs.text_offset]
                    offsets[index] = start + len(choice.text)
                if sample.finish_reason is not None:
                    finished.add(index)
                yield CompletionChunk(id=request_id, created=created, model=model, choices=[choice])

        def usage_chunk(usage: UsageInfo) -> CompletionChunk:
            return CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)

        return openai_events(streams, raw_request, chunks, usage_chunk if request.include_usage else None)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = self.token_text(token_id, entry)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            top = {
                self.token_text(t, entry): max(lp.logprob, MIN_LOGPROB) for t, lp in top_logprobs(entry, k)
            }
            top.setdefault(token, out.token_logprobs[-1])
            out.top_logprobs.append(top)
        return out


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
