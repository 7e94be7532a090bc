"""`AsyncLLM`: the engine for servers and other asyncio programs.

One thread owns the `LLMEngine` and steps it while there is work. Callers add and abort requests through a
thread-safe inbox (functions the engine thread runs between steps) and read each request's outputs from its
own asyncio queue, fed with `loop.call_soon_threadsafe`. A step never blocks the event loop, concurrent
requests share every step, a request the model runner fails on fails alone (`RequestOutput.error`), and a
step that raises fails the requests it held, not the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from pagellm.core.config import EngineConfig
from pagellm.core.errors import PagellmError
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.scheduler import SchedulerStats
from pagellm.sampling.params import SamplingParams

logger = logging.getLogger("pagellm")

_ACCEPTED = object()


class EngineError(PagellmError):
    """The engine failed (or shut down) while running a request; that request ends, the engine carries on.

    The message names the request and is safe to show its client; what went wrong is in the log."""


_FAILED = "the engine failed while running it; the log has the details under this request id"


@dataclass
class FinishedRequestStats:
    finish_reason: str  # of the first sample: stop, length, abort, or error
    num_prompt_tokens: int
    num_generation_tokens: int  # all samples together
    e2e_latency: float
    time_per_output_token: float | None  # None when fewer than two tokens came out


@dataclass
class IterationStats:
    """What one turn of the engine loop produced, for metrics."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token (or ended) this turn
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration: IterationStats) -> None:
        """Called on the engine thread after every turn of the loop; must be quick and thread-safe."""


class RequestStream:
    """The outputs of one request in order (`async for`); ends after the finished output. Iterating raises
    EngineError when the engine failed the request. `abort()` ends it early and frees its KV blocks."""

    def __init__(self, request_id: str, llm: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._llm = llm
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Hand an output, an exception or the acceptance to the caller's loop (from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request, for its stream and the metrics."""

    stream: RequestStream
    delta: bool
    num_prompt_tokens: int = 0
    prompt_counted: bool = False
    output_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens so far


class AsyncLLM:
    """AsyncLLM(model=..., **engine settings): the same keywords as `LLM`. Use `generate()` or
    `add_request()` from a running event loop; call `shutdown()` when done."""

    def __init__(self, model: str | None = None, stat_loggers: list[StatLogger] | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self.stat_loggers = list(stat_loggers or [])
        self._inbox: queue.Queue[Callable[[IterationStats], None]] = queue.Queue()
        self._requests: dict[str, _Tracked] = {}
        self._outbox: list[tuple[RequestStream, Any]] = []  # engine thread only; see _deliver
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="pagellm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> AsyncLLM:
        return cls(
            stat_loggers=stat_loggers, **{name: getattr(config, name) for name in config.field_names()}
        )

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Start calling `stat_logger.record` after every turn of the engine loop."""
        self.stat_loggers.append(stat_logger)

    # -- read-only facts the server needs -------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds at once, all requests together."""
        return self.engine.scheduler.kv_cache_manager.capacity_tokens

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # -- requests ---------------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it; invalid input raises here (ConfigError or
        ValueError), so a server can answer 400 before it starts a response."""
        if not self.is_running:
            raise EngineError("the engine is shut down; start a new AsyncLLM")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        arrival = time.monotonic()
        self._inbox.put(partial(self._add, stream, prompt, sampling_params, priority, arrival))
        try:
            first = await stream._queue.get()
        except asyncio.CancelledError:
            stream.abort()
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    async def generate(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative or delta, as `sampling_params.output_kind` says). Leaving
        the loop early, or cancelling the task that iterates, aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request in any state; its KV blocks are freed on the engine thread's next turn."""
        self._inbox.put(partial(self._abort, request_id))

    def shutdown(self) -> None:
        """Stop the engine thread; requests still running end with EngineError."""
        if self._stopping:
            return
        self._stopping = True
        self._inbox.put(lambda iteration: None)
        self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._turn()
        except BaseException:
            logger.exception("the engine thread died")
        finally:
            self._stopping = True
            iteration = IterationStats()
            self._run(self._next_commands(wait=False), iteration)
            self._fail_all("the engine shut down before it finished", iteration)
            self._deliver()

    def _turn(self) -> None:
        iteration = IterationStats()
        self._run(self._next_commands(wait=not self.engine.has_unfinished_requests()), iteration)
        if self.engine.has_unfinished_requests() and not self._stopping:
            self._step(iteration)
        stats = self.engine.stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)
        self._deliver()

    def _deliver(self) -> None:
        """Hand the turn's outputs to their callers, after the metrics counted them: a client that saw its
        request finish then finds it in the metrics."""
        for stream, item in self._outbox:
            stream.put(item)
        self._outbox.clear()

    def _run(self, commands: list[Callable[[IterationStats], None]], iteration: IterationStats) -> None:
        for command in commands:
            try:
                command(iteration)
            except Exception:
                logger.exception("an engine command failed")

    def _next_commands(self, wait: bool) -> list[Callable[[IterationStats], None]]:
        """Everything in the inbox; with `wait` (the engine has no work), block for the first command."""
        commands = [self._inbox.get()] if wait else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _add(
        self,
        stream: RequestStream,
        prompt: str | dict | list[int],
        params: SamplingParams | None,
        priority: int,
        arrival: float,
        iteration: IterationStats,
    ) -> None:
        params = params or self.engine.default_sampling_params()
        try:
            self.engine.add_request(prompt, params, stream.request_id, priority, arrival)
        except Exception as exc:
            self._outbox.append((stream, exc))
            return
        self._requests[stream.request_id] = _Tracked(stream, params.output_kind == "delta")
        self._outbox.append((stream, _ACCEPTED))

    def _abort(self, request_id: str, iteration: IterationStats) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._observe(tracked, output, iteration)
            self._outbox.append((tracked.stream, output))

    def _step(self, iteration: IterationStats) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception(
                "an engine step failed; failing the requests it held: %s", ", ".join(self._requests)
            )
            self._fail_all(_FAILED, iteration)
            return
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue
            if output.error is not None:  # the engine logged why, under the request id
                self._observe(tracked, output, iteration, finish_reason="error")
                self._outbox.append((tracked.stream, _engine_error(output.request_id, _FAILED)))
                del self._requests[output.request_id]
                continue
            self._observe(tracked, output, iteration)
            self._outbox.append((tracked.stream, output))
            if output.finished:
                del self._requests[output.request_id]

    def _fail_all(self, reason: str, iteration: IterationStats) -> None:
        for request_id, tracked in list(self._requests.items()):
            del self._requests[request_id]
            try:
                output = self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
                output = None
            if output is not None:
                self._observe(tracked, output, iteration, finish_reason="error")
            self._outbox.append((tracked.stream, _engine_error(request_id, reason)))

    def _observe(
        self,
        tracked: _Tracked,
        output: RequestOutput,
        iteration: IterationStats,
        finish_reason: str | None = None,
    ) -> None:
        tracked.num_prompt_tokens = len(output.prompt_token_ids)
        for sample in output.outputs:
            before = tracked.output_tokens.get(sample.index, 0)
            now = before + len(sample.token_ids) if tracked.delta else len(sample.token_ids)
            tracked.output_tokens[sample.index] = now
            iteration.num_generation_tokens += now - before
        num_generated = sum(tracked.output_tokens.values())
        if not tracked.prompt_counted and (num_generated or output.finished):
            tracked.prompt_counted = True
            iteration.num_prompt_tokens += tracked.num_prompt_tokens
            ttft = output.metrics.time_to_first_token if output.metrics else None
            if ttft is not None:
                iteration.time_to_first_tokens.append(ttft)
        if output.finished:
            iteration.finished.append(_finished_stats(tracked, output, finish_reason))


def _engine_error(request_id: str, reason: str) -> EngineError:
    return EngineError(f"request {request_id} failed: {reason}")


def _finished_stats(
    tracked: _Tracked, output: RequestOutput, finish_reason: str | None
) -> FinishedRequestStats:
    metrics = output.metrics
    e2e = metrics.e2e_latency if metrics and metrics.e2e_latency is not None else 0.0
    tokens = max(tracked.output_tokens.values(), default=0)
    tpot = None
    if metrics and metrics.first_token_time is not None and metrics.finished_time is not None and tokens > 1:
        tpot = (metrics.finished_time - metrics.first_token_time) / (tokens - 1)
    return FinishedRequestStats(
        finish_reason=finish_reason or output.outputs[0].finish_reason or "abort",
        num_prompt_tokens=tracked.num_prompt_tokens,
        num_generation_tokens=sum(tracked.output_tokens.values()),
        e2e_latency=e2e,
        time_per_output_token=tpot,
    )
