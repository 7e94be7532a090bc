"""`EngineCore`: the loop that owns an `LLMEngine` for `AsyncLLM` (and for each data-parallel copy), on a
thread or in a process of its own.

Between steps it runs the commands that arrived (add, abort, shut down, ...); each turn of the loop becomes one
`Turn` (what each request got, the scheduler's stats, what the turn produced for metrics) handed to `emit`.
Commands and turns are plain data, so the same loop runs behind a queue on a thread or behind sockets in
another process. A request the model runner fails on fails alone (its error output), and a step that
raises fails the requests it held, not the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.errors import PagellmError
from pagellm.core.pooling import PoolingParams
from pagellm.distributed import RankFailure
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.scheduler import SchedulerStats
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams

logger = logging.getLogger("pagellm")

ACCEPTED = "accepted"  # the item a request gets when the engine queued it
FAILED = "the engine failed while running it; the log has the details under this request id"


class EngineError(PagellmError):
    """The engine failed (or shut down) while running a request; that request ends, the engine carries on.

    The message names the request and is safe to show its client; what went wrong is in the log."""


# -- commands -------------------------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt: str | dict | list[int]
    params: SamplingParams | PoolingParams | None  # PoolingParams: an embedding request
    priority: int
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    reason: str = "the engine shut down before it finished"


@dataclass
class ValidateRequest:
    """Check a request as AddRequest would (and load its adapter) without queuing it: the item is ACCEPTED
    or the error. For a front end without an engine of its own that checks a batch before running any."""

    request_id: str
    prompt: str | dict | list[int]
    params: SamplingParams | PoolingParams | None  # PoolingParams: an embedding request
    lora_request: LoRARequest | None = None


@dataclass
class ResetPrefixCache:
    pass


Command = AddRequest | AbortRequest | Shutdown | ValidateRequest | ResetPrefixCache


# -- what a turn produced -------------------------------------------------------------------------------


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


@dataclass
class Turn:
    """One turn of the loop. `items` pairs a request id with ACCEPTED, a RequestOutput or an exception (the
    request ends with it); `last` marks the loop's final turn."""

    items: list[tuple[str, Any]]
    scheduler_stats: SchedulerStats
    iteration: IterationStats
    last: bool = False


@dataclass
class _Tracked:
    """Per-request bookkeeping for the metrics."""

    delta: bool
    num_prompt_tokens: int = 0
    prompt_counted: bool = False
    output_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens so far


IDLE_S = 0.5
"""How long the engine has had no request before it starts what it put off (`LLMEngine.on_idle`): a
client that sends its next request at once is not slowed by it."""


class EngineCore:
    """Runs `engine` until a Shutdown command: `receive(wait)` returns the commands that arrived (with
    `wait` True, the engine is idle: block for at least one; a number: for up to that many seconds),
    `emit(turn)` takes each turn's results. Work the engine puts off while it serves (`waits_for_idle`) is
    started once it has been idle for IDLE_S."""

    def __init__(self, engine: LLMEngine, emit: Callable[[Turn], None]):
        self.engine = engine
        self._emit = emit
        self._requests: dict[str, _Tracked] = {}
        self._items: list[tuple[str, Any]] = []
        self._stop_reason: str | None = None

    def run(self, receive: Callable[[bool], list[Command]]) -> None:
        iteration = IterationStats()
        try:
            while self._stop_reason is None:
                iteration = IterationStats()
                idle = not self.engine.has_unfinished_requests()
                if idle and self.engine.waits_for_idle():
                    commands = receive(IDLE_S)
                    if not commands:
                        self.engine.on_idle()
                        continue
                else:
                    commands = receive(idle)
                self._run(commands, iteration)
                if self.engine.has_unfinished_requests() and self._stop_reason is None:
                    self._step(iteration)
                self._emit(Turn(self._take_items(), self.engine.stats(), iteration))
        except BaseException:
            logger.exception("the engine loop died")
            self._stop_reason = "the engine failed; the log says why"
        finally:
            iteration = IterationStats()
            self._fail_all(self._stop_reason or "the engine shut down before it finished", iteration)
            self._emit(Turn(self._take_items(), self.engine.stats(), iteration, last=True))

    def _take_items(self) -> list[tuple[str, Any]]:
        items, self._items = self._items, []
        return items

    def _run(self, commands: list[Command], iteration: IterationStats) -> None:
        for command in commands:
            try:
                if isinstance(command, AddRequest):
                    self._add(command)
                elif isinstance(command, AbortRequest):
                    self._abort(command.request_id, iteration)
                elif isinstance(command, ValidateRequest):
                    self._validate(command)
                elif isinstance(command, ResetPrefixCache):
                    self.engine.reset_prefix_cache()
                else:
                    self._stop_reason = command.reason
            except Exception:
                logger.exception("an engine command failed: %r", command)

    def _add(self, command: AddRequest) -> None:
        params = command.params or self.engine.default_sampling_params()
        try:
            self.engine.add_request(
                command.prompt,
                params,
                command.request_id,
                command.priority,
                command.arrival_time,
                lora_request=command.lora_request,
            )
        except Exception as exc:
            self._items.append((command.request_id, exc))
            return
        self._requests[command.request_id] = _Tracked(getattr(params, "output_kind", None) == "delta")
        self._items.append((command.request_id, ACCEPTED))

    def _validate(self, command: ValidateRequest) -> None:
        params = command.params or self.engine.default_sampling_params()
        try:
            self.engine.validate(self.engine.tokenize(command.prompt)[1], params)
            if command.lora_request is not None:
                self.engine.runner.add_lora(command.lora_request)
        except Exception as exc:
            self._items.append((command.request_id, exc))
            return
        self._items.append((command.request_id, ACCEPTED))

    def _abort(self, request_id: str, iteration: IterationStats) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._observe(tracked, output, iteration)
            self._items.append((request_id, output))

    def _step(self, iteration: IterationStats) -> None:
        try:
            outputs = self.engine.step()
        except RankFailure as exc:  # the model's ranks are gone: this engine cannot run anything more
            self._stop_reason = str(exc)
            return
        except Exception:
            logger.exception(
                "an engine step failed; failing the requests it held: %s", ", ".join(self._requests)
            )
            self._fail_all(FAILED, iteration)
            return
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue
            if output.error is not None:  # the engine logged why, under the request id
                self._observe(tracked, output, iteration, finish_reason="error")
                self._items.append((output.request_id, engine_error(output.request_id, FAILED)))
                del self._requests[output.request_id]
                continue
            self._observe(tracked, output, iteration)
            self._items.append((output.request_id, output))
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
            self._items.append((request_id, engine_error(request_id, reason)))

    def _observe(
        self,
        tracked: _Tracked,
        output: RequestOutput,
        iteration: IterationStats,
        finish_reason: str | None = None,
    ) -> None:
        tracked.num_prompt_tokens = len(output.prompt_token_ids)
        for sample in output.outputs if isinstance(output, RequestOutput) else ():  # a pooling output: none
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


def engine_error(request_id: str, reason: str) -> EngineError:
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
        finish_reason=finish_reason
        or (output.outputs[0].finish_reason if isinstance(output, RequestOutput) else None)
        or ("abort" if getattr(output, "aborted", True) else "stop"),
        num_prompt_tokens=tracked.num_prompt_tokens,
        num_generation_tokens=sum(tracked.output_tokens.values()),
        e2e_latency=e2e,
        time_per_output_token=tpot,
    )
