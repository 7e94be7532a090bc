"""`AsyncLLM`: the engine for servers and other asyncio programs.

An `EngineCore` owns the `LLMEngine` and steps it while there is work: in a process of its own by default
(`engine_process=True`; see `core_process` for why), or on a thread of this process (`engine_process=False`,
where `self.engine` is the live engine, for tests and for plugins registered in-process rather than through
entry points); with `data_parallel_size` N > 1, in N processes behind this front end (`data_parallel`).
Callers add and abort requests as commands the core runs between steps, and read each request's outputs
from its own asyncio queue, fed with `loop.call_soon_threadsafe`. A step never blocks
the event loop, concurrent requests share every step, a request the model runner fails on fails alone
(`RequestOutput.error`), and a step that raises fails the requests it held, not the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.pooling import Pooler, PoolingParams
from pagellm.engine.core import (
    ACCEPTED,
    AbortRequest,
    AddRequest,
    Command,
    EngineCore,
    EngineError,
    FinishedRequestStats,
    IterationStats,
    Shutdown,
    Turn,
    engine_error,
)
from pagellm.engine.core_process import EngineFacts, EngineProcess
from pagellm.engine.data_parallel import DataParallelEngines, check_data_parallel
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import PoolingRequestOutput, RequestOutput
from pagellm.engine.process_launch import EngineLaunch
from pagellm.engine.scheduler import SchedulerStats
from pagellm.engine.tokenizer import TokenizerPreload
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams

__all__ = [
    "AsyncLLM",
    "EngineError",
    "OverloadedError",
    "RequestTimeoutError",
    "FinishedRequestStats",
    "IterationStats",
    "RequestStream",
    "StatLogger",
]

logger = logging.getLogger("pagellm")


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration: IterationStats) -> None:
        """Called after every turn of the engine loop, off the event loop; must be quick and thread-safe."""


class RequestStream:
    """The outputs of one request in order (`async for`); ends after the finished output. Iterating raises
    EngineError when the engine failed the request. `abort()` ends it early and frees its KV blocks."""

    def __init__(self, request_id: str, llm: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._llm = llm
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._deadline: asyncio.TimerHandle | None = None  # --request-timeout's

    def expire_after(self, seconds: float) -> None:
        """Abort the request `seconds` from now unless it has finished: its caller gets a
        RequestTimeoutError, the engine frees what it held."""
        self._deadline = self._loop.call_later(seconds, self._expire, seconds)

    def _expire(self, seconds: float) -> None:
        if self.finished:
            return
        self._llm.abort(self.request_id)  # the caller reads the error after what came before it
        message = (
            f"request {self.request_id} took longer than {seconds:g} s (--request-timeout) and was aborted"
        )
        self._queue.put_nowait(RequestTimeoutError(message))

    def put(self, item: Any) -> None:
        """Hand an output, an exception or the acceptance to the caller's loop (from the thread that delivers turns)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)
        if self._deadline is not None:
            self._deadline.cancel()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        self.finished = isinstance(item, BaseException) or item.finished
        if self.finished and self._deadline is not None:
            self._deadline.cancel()
        if isinstance(item, BaseException):
            raise item
        return item


class OverloadedError(EngineError):
    """The queue is full (`max_waiting_requests`): the request was not queued; try again after
    `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(EngineError):
    """The request ran past `request_timeout` and was aborted."""


class AsyncLLM:
    """AsyncLLM(model=..., **engine settings): the same keywords as `LLM`, plus `engine_process` and
    `launched` (an engine process launched beforehand, `process_launch.EngineLaunch`, adopted where one
    engine process runs, else discarded). Use `generate()` or `add_request()` from a running event loop;
    call `shutdown()` when done."""

    def __init__(
        self,
        model: str | None = None,
        stat_loggers: list[StatLogger] | None = None,
        engine_process: bool = True,
        launched: EngineLaunch | None = None,
        **kwargs: Any,
    ):
        try:
            self._init(model, stat_loggers, engine_process, launched, kwargs)
        finally:
            if launched is not None:
                launched.discard()  # nothing where an engine process adopted it

    def _init(
        self,
        model: str | None,
        stat_loggers: list[StatLogger] | None,
        engine_process: bool,
        launched: EngineLaunch | None,
        kwargs: dict[str, Any],
    ) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        check_data_parallel(self.config)
        if self.config.data_parallel_size > 1 and not engine_process:
            raise ConfigError(
                "data_parallel_size > 1 runs each engine copy in a process of its own, and "
                "engine_process=False runs one engine on a thread; leave engine_process at True"
            )
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, RequestStream] = {}
        self.num_rejected = 0  # requests refused because the queue was full (max_waiting_requests)
        self.engine_failure: str | None = None  # why the engine ended on its own, once it has
        self._exit_listeners: list[Callable[[str], None]] = []
        self._accepting = 0  # requests sent to the engine, not yet accepted: not in latest_stats yet
        self._stopping = False
        self._ended = threading.Event()  # the core's last turn was delivered
        self.engine: LLMEngine | None = None
        self._process: EngineProcess | DataParallelEngines | None = None
        if self.config.data_parallel_size > 1:
            preload = TokenizerPreload(self.config)
            self._process = DataParallelEngines(self.config, self._on_turn, self._on_exit)
        elif engine_process:
            process = EngineProcess(self.config, self._on_turn, self._on_exit, launched=launched, wait=False)
            preload = TokenizerPreload(self.config)  # once the settings went: its imports hold the GIL
            try:
                process.wait_ready()
            except BaseException:
                process.close(wait=False)
                raise
            self._process = process
        if self._process is not None:
            self.facts = self._process.facts
            self._tokenizer = preload.tokenizer(self.facts.tokenizer_path)
            self._send = self._process.send
        else:
            self.engine = LLMEngine(self.config)
            self.facts = EngineFacts.of(self.engine)
            self._tokenizer = self.engine.tokenizer
            inbox: queue.Queue[Command] = queue.Queue()
            self._send = inbox.put
            core = EngineCore(self.engine, self._on_turn)
            self._thread = threading.Thread(
                target=core.run, args=(queue_receiver(inbox),), name="pagellm-engine", daemon=True
            )
            self._thread.start()
        self.latest_stats: SchedulerStats = self.facts.scheduler_stats

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        stat_loggers: list[StatLogger] | None = None,
        engine_process: bool = True,
        launched: EngineLaunch | None = None,
    ) -> AsyncLLM:
        return cls(
            stat_loggers=stat_loggers,
            engine_process=engine_process,
            launched=launched,
            **{name: getattr(config, name) for name in config.field_names()},
        )

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Start calling `stat_logger.record` after every turn of the engine loop."""
        self.stat_loggers.append(stat_logger)

    # -- read-only facts the server needs -------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def takes_images(self) -> bool:
        """Whether the model's prompts may hold images."""
        return self.facts.takes_images

    @property
    def pooler(self) -> Pooler | None:
        """A pooling engine's pooling and classification head (None for a generating one)."""
        return self.facts.pooler

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds at once, all requests together."""
        return self.facts.kv_cache_tokens

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**vars(self.facts.default_params))

    @property
    def is_running(self) -> bool:
        if self._stopping or self._ended.is_set():
            return False
        return self._process.is_alive if self._process is not None else self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it; invalid input raises here (ConfigError or
        ValueError), so a server can answer 400 before it starts a response."""
        if not self.is_running:
            raise EngineError("the engine is shut down; start a new AsyncLLM")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._streams:
            raise ConfigError(f"request id {request_id!r} is already running")
        self._check_queue()
        queued = time.monotonic()
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(AddRequest(request_id, prompt, sampling_params, priority, time.monotonic(), lora_request))
        self._accepting += 1
        try:
            first = await stream._queue.get()
        except asyncio.CancelledError:
            stream.abort()
            raise
        finally:
            self._accepting -= 1
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        if self.config.request_timeout is not None:
            stream.expire_after(max(0.0, self.config.request_timeout - (time.monotonic() - queued)))
        return stream

    def _check_queue(self) -> None:
        """OverloadedError when `max_waiting_requests` are waiting: those the engine reported after its
        last turn plus those sent since and not yet accepted."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        waiting = self.latest_stats.num_waiting + self._accepting
        if waiting >= limit:
            self.num_rejected += 1
            raise OverloadedError(
                f"the server is overloaded: {waiting} requests are waiting (--max-waiting-requests {limit}); "
                "retry later",
                retry_after_s=1,
            )

    async def generate(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative or delta, as `sampling_params.output_kind` says). Leaving
        the loop early, or cancelling the task that iterates, aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority, lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def encode(
        self,
        prompt: str | dict | list[int],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """An embedding request (runner="pooling"): yields its one output, `.outputs.embedding`, when its
        prompt has run. Leaving early or cancelling aborts it."""
        stream = await self.add_request(
            prompt, pooling_params or PoolingParams(), request_id, priority, lora_request
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request in any state; the engine frees its KV blocks on its next turn."""
        if self.is_running:
            self._send(AbortRequest(request_id))

    def shutdown(self) -> None:
        """Stop the engine; requests still running end with EngineError."""
        if self._stopping:
            return
        self._stopping = True
        if self._process is not None:
            if self._process.is_alive:
                self._process.send(Shutdown())
            self._process.close()
        else:
            self._send(Shutdown())
            self._thread.join(timeout=30)
            self.engine.shutdown()
        self._fail_streams("the engine shut down before it finished")

    # -- turns, on the engine thread or the process's receiver thread --------------------------------------

    def _on_turn(self, turn: Turn) -> None:
        """Count the turn in the metrics, then hand its items to their callers: a client that saw its
        request finish then finds it in the metrics."""
        self.latest_stats = turn.scheduler_stats
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(turn.scheduler_stats, turn.iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)
        for request_id, item in turn.items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if item != ACCEPTED and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
            stream.put(item)
        if turn.last:
            self._ended.set()
            self._fail_streams("the engine shut down before it finished")

    def on_engine_exit(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` (on a background thread) if the engine ends on its own: its process died,
        a data-parallel rank failed. A server stops then, so that a supervisor restarts it."""
        self._exit_listeners.append(listener)

    def _on_exit(self, reason: str) -> None:
        logger.error("%s; failing its %d requests", reason, len(self._streams))
        self.engine_failure = reason
        self._ended.set()
        self._fail_streams(reason)
        for listener in self._exit_listeners:
            listener(reason)

    def _fail_streams(self, reason: str) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(engine_error(request_id, reason))


def queue_receiver(inbox: queue.Queue[Command]):
    """`EngineCore.run`'s receive over a thread-safe queue: everything queued; when idle, block for one (for
    up to `wait` seconds where it is a number)."""

    def receive(wait: bool | float) -> list[Command]:
        if isinstance(wait, bool):
            commands = [inbox.get()] if wait else []
        else:
            try:
                commands = [inbox.get(timeout=wait)]
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(inbox.get_nowait())
            except queue.Empty:
                return commands

    return receive
