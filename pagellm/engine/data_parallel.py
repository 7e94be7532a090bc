"""Data parallelism (`data_parallel_size` N > 1): N copies of the engine, each an `EngineProcess` with its
own model and KV cache, behind one front end (`AsyncLLM`, `LLM`, the server).

Why: one engine's step stops getting faster with more cores (or requests) long before a big machine runs
out of them; N engines each step their own batch on their own share of the cores. The cost is N copies
of the weights and N KV caches.

A request goes to the copy (rank) with the fewest unfinished requests, ties to the lowest rank, and stays
there; its abort follows it. Every rank's turns reach the front end as they come, carrying the scheduler
stats of all ranks added up. A rank that dies ends the whole front end, as a dead single engine does:
every request still running fails with an EngineError that names the rank, `is_alive` turns false (so the
server's /health answers 503), and the other ranks are shut down.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.core import (
    AbortRequest,
    AddRequest,
    Command,
    EngineError,
    ResetPrefixCache,
    Shutdown,
    Turn,
    ValidateRequest,
)
from pagellm.engine.core_process import EngineFacts, EngineProcess
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.scheduler import SchedulerStats
from pagellm.engine.tokenizer import load_tokenizer
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams

logger = logging.getLogger("pagellm")

_READY_POLL_S = 0.05


def check_data_parallel(config: EngineConfig) -> None:
    """Start-up checks of `data_parallel_size`, before any process starts."""
    size = config.data_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"data_parallel_size must be a whole number >= 1 (engine copies), got {size!r}")


def child_environment(size: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of each of `size` engine processes: ours, with OMP_NUM_THREADS (torch's CPU threads)
    set to this process's usable cores // size, at least 1, so the copies do not fight over the same cores.
    An OMP_NUM_THREADS already set is left as it is: whoever set it chose."""
    env = dict(os.environ if environ is None else environ)
    if not env.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // size))
    return env


def aggregate_stats(stats: Sequence[SchedulerStats], capacities: Sequence[int]) -> SchedulerStats:
    """Several ranks' SchedulerStats as one: counts (and the cumulative counters) summed, flags true when every rank's is, per-position
    counts summed position by position, and `kv_cache_usage` weighted by each rank's KV capacity in tokens,
    i.e. the fraction of all ranks' KV tokens in use (the plain mean when the ranks are alike)."""
    values: dict[str, Any] = {}
    total = sum(capacities)
    for f in dataclasses.fields(SchedulerStats):
        column = [getattr(s, f.name) for s in stats]
        if f.name == "kv_cache_usage":
            weighted = sum(u * c for u, c in zip(column, capacities, strict=True))
            values[f.name] = weighted / total if total else sum(column) / len(column)
        elif isinstance(column[0], bool):  # a fact of every rank: true when it holds for all
            values[f.name] = all(column)
        elif isinstance(column[0], tuple):
            values[f.name] = tuple(sum(c) for c in itertools.zip_longest(*column, fillvalue=0))
        else:
            values[f.name] = sum(column)
    return SchedulerStats(**values)


class DataParallelEngines:
    """`config.data_parallel_size` engine processes behind one front end, with EngineProcess's interface
    (`send`, `is_alive`, `facts`, `close`) and its callbacks: `on_turn(turn)` for each rank's turns (with
    the stats of all ranks) and `on_exit(reason)` once, when a rank dies; both are called one at a time.

    Start-up: every rank loads at once (each with `data_parallel_size=1`, `seed + rank` and its share of
    the cores); the first failure is raised here, as EngineProcess raises it, and every rank is stopped."""

    def __init__(
        self,
        config: EngineConfig,
        on_turn: Callable[[Turn], None],
        on_exit: Callable[[str], None],
    ):
        check_data_parallel(config)
        self.size = config.data_parallel_size
        self._on_turn = on_turn
        self._on_exit = on_exit
        self._lock = threading.RLock()
        self._owner: dict[str, int] = {}  # unfinished request id -> its rank
        self.unfinished = [0] * self.size  # unfinished requests per rank: what routing balances
        self.routed = [0] * self.size  # requests each rank was given, ever
        self._ended = [False] * self.size  # the rank's last turn arrived
        self._stopping = False
        self.failure: str | None = None  # why the front end ended: "data-parallel rank R: ..."
        env = child_environment(self.size)
        launch = None
        if config.distributed_executor_backend == "ray":  # the copies as Ray actors, on any machine
            from pagellm.engine.ray_engine import ray_launcher

            launch = ray_launcher(config.device)
        self.ranks: list[EngineProcess] = []
        try:
            for rank in range(self.size):
                self.ranks.append(
                    EngineProcess(
                        # seed + rank: unseeded requests on two ranks must not draw the same random numbers
                        config.replace(data_parallel_size=1, seed=config.seed + rank),
                        functools.partial(self._rank_turn, rank),
                        functools.partial(self._rank_exit, rank),
                        env=env,
                        wait=False,
                        log_prefix=f"[dp{rank}] ",
                        launch=launch,
                    )
                )
            self._wait_ready()
        except BaseException:
            for process in self.ranks:
                process.close(wait=False)
            raise
        facts = [process.facts for process in self.ranks]
        self._capacities = [f.kv_cache_tokens for f in facts]
        self._stats = [f.scheduler_stats for f in facts]
        # one request runs on one rank, so the most a request may hold is one rank's KV cache
        self.facts: EngineFacts = dataclasses.replace(
            facts[0], kv_cache_tokens=min(self._capacities), scheduler_stats=self.stats()
        )

    def _wait_ready(self) -> None:
        pending = list(range(self.size))
        while pending:
            for rank in list(pending):
                try:
                    if self.ranks[rank].wait_ready(timeout=_READY_POLL_S):
                        pending.remove(rank)
                except EngineError as exc:
                    raise EngineError(f"data-parallel rank {rank}: {exc}") from exc
                except BaseException:
                    logger.error("data-parallel rank %d failed to start; stopping the others", rank)
                    raise
        if self.failure is not None:
            raise EngineError(self.failure)

    @property
    def is_alive(self) -> bool:
        return self.failure is None and not self._stopping and all(process.is_alive for process in self.ranks)

    def stats(self) -> SchedulerStats:
        """The latest stats of all ranks as one (see `aggregate_stats`)."""
        with self._lock:
            return aggregate_stats(self._stats, self._capacities)

    def send(self, command: Command) -> None:
        """Add: to the rank with the fewest unfinished requests (ties: the lowest). Abort: to the request's
        rank. Validate: to rank 0 (every rank checks alike). Shutdown and the rest: to every rank."""
        with self._lock:
            if isinstance(command, AddRequest):
                rank = min(range(self.size), key=self.unfinished.__getitem__)
                self._owner[command.request_id] = rank
                self.unfinished[rank] += 1
                self.routed[rank] += 1
                self.ranks[rank].send(command)
            elif isinstance(command, AbortRequest):
                rank = self._owner.pop(command.request_id, None)
                if rank is not None:
                    self.unfinished[rank] -= 1
                    self.ranks[rank].send(command)
            elif isinstance(command, ValidateRequest):
                self.ranks[0].send(command)
            else:
                if isinstance(command, Shutdown):
                    self._stopping = True
                for process in self.ranks:
                    if process.is_alive:
                        process.send(command)

    def close(self, wait: bool = True, timeout: float = 30.0) -> None:
        """Stop every rank (a Shutdown to each still running) and wait for its process, as EngineProcess.close."""
        with self._lock:
            if wait and not self._stopping and self.failure is None:  # else every rank was sent one
                self.send(Shutdown())
            self._stopping = True
        for process in self.ranks:
            process.close(wait=wait, timeout=timeout)

    # -- from the ranks' receiver threads ------------------------------------------------------------------

    def _rank_turn(self, rank: int, turn: Turn) -> None:
        with self._lock:
            self._stats[rank] = turn.scheduler_stats
            for request_id, item in turn.items:
                ended = isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished)
                if ended and self._owner.get(request_id) == rank:
                    del self._owner[request_id]
                    self.unfinished[rank] -= 1
            if turn.last:
                self._ended[rank] = True
                self._fail(rank, "its engine loop stopped; the log says why")
            merged = Turn(turn.items, aggregate_stats(self._stats, self._capacities), turn.iteration)
            merged.last = all(self._ended)
            self._on_turn(merged)

    def _rank_exit(self, rank: int, reason: str) -> None:
        with self._lock:
            self._fail(rank, reason)

    def _fail(self, rank: int, reason: str) -> None:
        """Rank `rank` ended unasked: end the front end (once), naming it, and stop the other ranks."""
        if self.failure is not None or self._stopping:
            return
        self.failure = f"data-parallel rank {rank}: {reason}"
        self._owner.clear()
        self.unfinished = [0] * self.size
        self._on_exit(self.failure)
        for other, process in enumerate(self.ranks):
            if other != rank and process.is_alive:
                process.send(Shutdown(f"the engine stopped: {self.failure}"))


class DataParallelClient:
    """The data-parallel engines driven synchronously, for `LLM`: the calls of `LLMEngine` that `LLM` makes
    (`add_request`, `abort_request`, `step`, `tokenizer`, ...), where `step()` waits for the next turn of
    any rank instead of running one, plus `validate_all`, which checks a batch before any of it runs."""

    def __init__(self, config: EngineConfig):
        self._turns: queue.Queue[Turn | str] = queue.Queue()  # a str: why the engines ended
        self.engines = DataParallelEngines(config, self._turns.put, self._turns.put)
        self._finalizer = weakref.finalize(self, _shutdown, self.engines)
        self.tokenizer = load_tokenizer(self.engines.facts.tokenizer_path)
        self.max_model_len = self.engines.facts.max_model_len
        self._unfinished: set[str] = set()

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**vars(self.engines.facts.default_params))

    def stats(self) -> SchedulerStats:
        return self.engines.stats()

    def validate_all(
        self,
        prompts: Sequence[str | dict | list[int]],
        params: Sequence[SamplingParams | None],
        loras: Sequence[LoRARequest | None],
    ) -> None:
        """Check every request as the engine would (rank 0 answers for all, loading adapters as it goes);
        raises the first failure in prompt order, with nothing queued."""
        self._check_alive()
        ids = [f"validate-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
            self.engines.send(ValidateRequest(request_id, prompt, p, lora))
        answers: dict[str, Any] = {}
        wanted = set(ids)
        while len(answers) < len(ids):
            answers.update((i, item) for i, item in self._next_turn().items if i in wanted)
        for request_id in ids:
            if isinstance(answers[request_id], BaseException):
                raise answers[request_id]

    def add_request(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request on the least loaded rank; returns its id. An error the rank finds comes from `step`."""
        self._check_alive()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self._unfinished.add(request_id)
        self.engines.send(AddRequest(request_id, prompt, params, priority, time.monotonic(), lora_request))
        return request_id

    def abort_request(self, request_id: str) -> None:
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self.engines.send(AbortRequest(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """Wait for the next turn of any rank and return its outputs; a request the engine failed raises
        its EngineError, and so does a rank that died."""
        if not self._unfinished:
            return []
        outputs = []
        for request_id, item in self._next_turn().items:
            if request_id not in self._unfinished or isinstance(item, str):  # ACCEPTED
                continue
            if isinstance(item, BaseException):
                self._unfinished.discard(request_id)
                raise item
            if item.finished:
                self._unfinished.discard(request_id)
            outputs.append(item)
        return outputs

    def reset_prefix_cache(self) -> None:
        self.engines.send(ResetPrefixCache())

    def shutdown(self) -> None:
        """Stop the engine processes (also done when this object is collected, or at exit)."""
        self._finalizer()

    def _check_alive(self) -> None:
        if not self.engines.is_alive:
            raise EngineError(f"{self.engines.failure or 'the engine is shut down'}; start a new LLM")

    def _next_turn(self) -> Turn:
        while True:
            try:
                message = self._turns.get(timeout=0.5)
            except queue.Empty:
                if self.engines.failure is not None:  # reported to an earlier call
                    message = self.engines.failure
                else:
                    continue
            if isinstance(message, str):
                self._unfinished.clear()
                raise EngineError(message)
            return message


def _shutdown(engines: DataParallelEngines) -> None:
    engines.close()
