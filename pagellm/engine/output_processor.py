"""Turns the scheduler's updated requests into outputs: for a generation request a `RequestOutput`
(detokenized incrementally, stop strings applied, the n samples of a parent request gathered, timing
recorded); for a pooling request a `PoolingRequestOutput` when it finishes (its pooled vector truncated to
`dimensions`, then L2-normalised if it asks).

`output_kind` decides what a generation request gets: "cumulative", every step, everything so far;
"delta", every step, only what is new; "final_only", one output when it finishes (or is aborted) and
nothing before, so a caller that waits for the end pays for no per-step copies."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.core.pooling import PoolingParams
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagellm.engine.request import Request
from pagellm.sampling.params import SamplingParams
from pagellm.worker.step import StepResult

logger = logging.getLogger("pagellm")


@dataclass
class _Child:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    sent_tokens: int = 0  # output tokens already given to the detokenizer
    delta_tokens: int = 0  # output tokens already returned, for output_kind="delta"
    finished: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child] = field(default_factory=list)
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


@dataclass
class _Pooling:
    """An unfinished pooling request: one request, one output when it finishes."""

    prompt: str | None
    request: Request


class OutputProcessor:
    """Tracks each unfinished request under the caller's id (`parents`, `pooling`), which its outputs
    carry, and its samples under the engine's ids (`child_to_parent`), which the step's requests carry."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, _Child]] = {}
        self.pooling: dict[str, _Pooling] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        children: list[Request],
        params: SamplingParams | PoolingParams,
    ) -> None:
        """Track a request's outputs (`request_id`: the caller's): a generation request's n children, or a
        pooling request's one."""
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = _Pooling(prompt, children[0])
            return
        parent = ParentState(request_id, prompt, list(children[0].prompt_token_ids), params)
        parent.metrics = RequestMetrics(arrival_time=children[0].arrival_time)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = []
        for i, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
            state = _Child(i, child, detok, [] if params.logprobs is not None else None)
            parent.children.append(state)
            self.child_to_parent[child.request_id] = (parent, state)
        self.parents[request_id] = parent

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id is unfinished."""
        return request_id in self.parents or request_id in self.pooling

    def child_ids(self, request_id: str) -> list[str]:
        """The engine's ids of the requests the scheduler runs for the caller's `request_id`."""
        if request_id in self.pooling:
            return [self.pooling[request_id].request.request_id]
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process(
        self, updated: list[Request], result: StepResult
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[tuple[str, str]]]:
        """New outputs for the parents touched this step (then those of the pooling requests that finished),
        and (child id, stop string) for each stop string matched (the engine finishes those in the
        scheduler)."""
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        touched: dict[str, ParentState] = {}
        moved: set[int] = set()  # ids of the children that got tokens or finished this step
        stopped: list[tuple[str, str]] = []
        pooled: list[PoolingRequestOutput] = []
        for request in updated:
            if request.pooling_params is not None:  # finished with its prompt
                entry = self.pooling.get(request.external_request_id)
                if entry is not None and entry.request is request:
                    vector = result.pooled.get(request.request_id)
                    pooled.append(self._pooled(request.external_request_id, vector))
                continue
            entry = self.child_to_parent.get(request.request_id)
            if entry is None:
                continue
            parent, child = entry
            touched[parent.request_id] = parent
            moved.add(id(child))
            if (
                parent.prompt_logprobs is not None
                and request.request_id in prompt_logprobs
                and child.index == 0
            ):
                parent.prompt_logprobs += [self._logprobs(e) for e in prompt_logprobs[request.request_id]]
            new_tokens = request.output_token_ids[child.sent_tokens :]
            # EOS or a stop token id ended it: that token's text is not part of the output
            stop_token = request.finish_reason == "stop" and not isinstance(request.stop_reason, str)
            matched = None
            for j, token_id in enumerate(new_tokens):  # several with speculative decoding
                last = j == len(new_tokens) - 1
                matched = child.detokenizer.update([token_id], stop_terminated=stop_token and last)
                if matched is not None:  # tokens after the stop string are not output
                    if not last:
                        request.truncate_output(child.sent_tokens + j + 1)
                        new_tokens = new_tokens[: j + 1]
                    break
            child.sent_tokens = request.num_output_tokens
            if child.logprobs is not None and request.request_id in logprobs:
                child.logprobs += [self._logprobs(e) for e in logprobs[request.request_id][: len(new_tokens)]]
            if matched is not None and not request.is_finished:
                request.stop_reason = matched
                stopped.append((request.request_id, matched))
                child.finished = True
            elif request.is_finished:
                child.finished = True
        now = time.monotonic()
        outputs = []
        for parent in touched.values():
            metrics = parent.metrics
            first = parent.children[0].request
            metrics.first_scheduled_time = metrics.first_scheduled_time or first.first_scheduled_time
            metrics.first_token_time = metrics.first_token_time or first.first_token_time
            metrics.num_cached_tokens = first.num_cached_tokens
            if parent.finished:
                metrics.finished_time = now
            elif parent.params.output_kind == "final_only":
                continue
            outputs.append(self._output(parent, moved=moved))
            if parent.finished:
                self._drop(parent)
        return outputs + pooled, stopped

    def abort(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        if request_id in self.pooling:
            return self._pooling_output(request_id, aborted=True)
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            child.finished = True
        parent.metrics.finished_time = time.monotonic()
        output = self._output(parent, aborted=True)
        self._drop(parent)
        return output

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_to_parent.pop(child.request.request_id, None)

    def _output(
        self, parent: ParentState, aborted: bool = False, moved: set[int] | None = None
    ) -> RequestOutput:
        """Cumulative and final only: every sample. Delta: only the samples that moved this step (all when
        aborting)."""
        delta = parent.params.output_kind == "delta"
        completions = []
        for child in parent.children:
            if delta and moved is not None and id(child) not in moved:
                continue
            r = child.request
            finish = (
                "abort" if aborted and not r.is_finished else (r.finish_reason if child.finished else None)
            )
            if child.finished and finish is None:
                finish = "stop"
            detok = child.detokenizer
            if delta:
                text = detok.get_delta(finished=child.finished)
                token_ids = r.output_token_ids[child.delta_tokens :]
                logprobs = child.logprobs[child.delta_tokens :] if child.logprobs is not None else None
                child.delta_tokens = r.num_output_tokens
            else:
                text = detok.visible_text(finished=child.finished)
                token_ids = list(r.output_token_ids)
                logprobs = list(child.logprobs) if child.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    child.index,
                    text,
                    token_ids,
                    logprobs,
                    finish,
                    r.stop_reason if finish == "stop" else None,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished or aborted,
            prompt_logprobs=parent.prompt_logprobs,
            metrics=parent.metrics,
            num_cached_tokens=parent.metrics.num_cached_tokens,
        )

    def _pooled(self, request_id: str, vector: torch.Tensor | None) -> PoolingRequestOutput:
        """A finished pooling request's output; an error output when the runner pooled nothing for it."""
        if vector is not None:
            return self._pooling_output(request_id, vector)
        exc = RuntimeError("the runner pooled nothing")
        logger.error("request %s failed in the model runner; ending it alone", request_id, exc_info=exc)
        output = self._pooling_output(request_id, aborted=True)
        output.error = f"the model runner failed on this request: {exc!r}"
        return output

    def _pooling_output(
        self, request_id: str, vector: torch.Tensor | None = None, aborted: bool = False
    ) -> PoolingRequestOutput:
        """The finished (or aborted) output of a pooling request: `vector` truncated to its dimensions, then
        L2-normalised if it asks."""
        entry = self.pooling.pop(request_id)
        request = entry.request
        embedding: list[float] = []
        if vector is not None:
            params = request.pooling_params
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
            embedding = vector.tolist()
        metrics = RequestMetrics(
            request.arrival_time,
            request.first_scheduled_time,
            finished_time=request.finished_time or time.monotonic(),
            num_cached_tokens=request.num_cached_tokens,
        )
        return PoolingRequestOutput(
            request_id,
            entry.prompt,
            request.prompt_token_ids,
            EmbeddingOutput(embedding),
            finished=True,
            metrics=metrics,
            num_cached_tokens=request.num_cached_tokens,
            aborted=aborted or vector is None,
        )

    def _logprobs(self, entry: dict[int, tuple[float, int]] | None) -> dict[int, Logprob] | None:
        if entry is None:
            return None
        return {
            t: Logprob(lp, rank, self.tokenizer.decode([t], skip_special_tokens=False))
            for t, (lp, rank) in entry.items()
        }
