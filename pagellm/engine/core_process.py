"""The engine core in a process of its own, for `AsyncLLM`: the front end (tokenizer, HTTP, streams) and
the engine (model, scheduler, detokenizer) no longer share one interpreter.

Why: torch ops on a second Python thread get an OpenMP team of their own, and on a small machine that
team and the main thread's compete; the same steps ran 20-40% slower on the engine thread than on the
main thread. A process runs the engine on its main thread, the way `LLM` does, and keeps the front end's
Python (JSON, SSE, tokenizing chat templates) off the cores the engine steps on.

The front end binds two ZeroMQ sockets in a private directory and starts a Python child that runs
`main(COMMANDS, TURNS)` (the two sockets' addresses): commands go down one socket, pickled, and every `Turn` comes back on
the other. A child that dies fails its requests (the front end notices within a fraction of a second);
a front end that dies makes the child exit at its next idle moment or turn.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.core.config import EngineConfig
from pagellm.core.pooling import Pooler
from pagellm.engine.core import Command, EngineCore, EngineError, Turn
from pagellm.engine.process_launch import EngineLaunch
from pagellm.engine.scheduler import SchedulerStats
from pagellm.sampling.params import SamplingParams

logger = logging.getLogger("pagellm")

_POLL_MS = 200
_FINAL_LINGER_MS = 500  # a live front end's socket takes the last turns at once; a stopping one may not


@dataclass
class EngineFacts:
    """What the front end needs to know of the engine, sent once it is ready."""

    max_model_len: int
    kv_cache_tokens: int
    default_params: SamplingParams
    tokenizer_path: str
    scheduler_stats: SchedulerStats
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS tokens (beam search ends beams on them)
    takes_images: bool = False  # the model's prompts may hold images
    pooler: Pooler | None = None  # runner="pooling": its pooling and classification head

    @classmethod
    def of(cls, engine: Any) -> EngineFacts:
        return cls(
            max_model_len=engine.max_model_len,
            kv_cache_tokens=engine.scheduler.kv_cache_manager.capacity_tokens,
            default_params=engine.default_sampling_params(),
            tokenizer_path=engine.setup.config.tokenizer or engine.setup.source.directory,
            scheduler_stats=engine.stats(),
            eos_token_ids=frozenset(engine.eos_token_ids),
            takes_images=engine.processor.images is not None,
            pooler=engine.processor.pooler,
        )


@dataclass
class _Start:
    config: EngineConfig
    log_level: int
    log_format: str | None
    log_prefix: str = ""


@dataclass
class _StartFailed:
    error: BaseException


class EngineProcess:
    """Starts the engine process for `config` and waits until it is ready (raising what its start-up
    raised). `on_turn` runs on a receiver thread for every turn; `on_exit(reason)` once, if the process
    ends without a last turn. `env`: the child's environment (default: ours). `wait=False` returns once
    the child is started, so several can load at once; then call `wait_ready` (and `close` if it raises).
    `log_prefix` starts each of the child's log lines (data parallelism names the rank there).
    `launch`: starts the child somewhere else (`process_launch.EngineLaunch` says how). `launched`: a child
    launched beforehand (`EngineLaunch`), which this adopts (then `env` and `launch` are not used)."""

    def __init__(
        self,
        config: EngineConfig,
        on_turn: Callable[[Turn], None],
        on_exit: Callable[[str], None],
        env: dict[str, str] | None = None,
        wait: bool = True,
        log_prefix: str = "",
        launch: Callable[[str, str, dict[str, str] | None], Any] | None = None,
        launched: EngineLaunch | None = None,
    ):
        self._on_turn = on_turn
        self._on_exit = on_exit
        launched = launched or EngineLaunch(env, launch)
        launched.adopted = True
        self._dir, self._context = launched.dir, launched.context
        self._commands, self._turns, self.process = launched.commands, launched.turns, launched.process
        self._send_lock = threading.Lock()
        self._closed = False
        self.facts: EngineFacts | None = None
        try:
            self._send(_Start(config, logger.getEffectiveLevel(), _log_format(), log_prefix))
            if wait:
                self.wait_ready()
        except BaseException:
            self.close(wait=False)
            raise

    @property
    def is_alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def send(self, command: Command) -> None:
        self._send(command)

    def _send(self, message: Any) -> None:
        """Send, waiting while the child's queue is full; a child that has exited (or is exiting: its socket
        is gone, so a plain send would block for ever) gets nothing."""
        import zmq

        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            while not self._closed:
                try:
                    self._commands.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if self.process.poll() is not None:
                        return
                    self._commands.poll(_POLL_MS, zmq.POLLOUT)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: as long as it takes) for the engine to load; True once it is
        ready (then `facts` is set and turns start flowing), raising what its start-up raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.facts is None:
            wait_ms = (
                _POLL_MS
                if deadline is None
                else max(0, min(_POLL_MS, int((deadline - time.monotonic()) * 1000)))
            )
            if self._turns.poll(wait_ms):
                message = pickle.loads(self._turns.recv())
                if isinstance(message, _StartFailed):
                    raise message.error
                self.facts = message
                self._receiver = threading.Thread(
                    target=self._receive, name="pagellm-engine-receiver", daemon=True
                )
                self._receiver.start()
                return True
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"the engine process exited with code {code} while starting; its log says why"
                )
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def _receive(self) -> None:
        while True:
            try:
                ready = self._turns.poll(_POLL_MS)
            except Exception:  # the socket was closed under us: close() is running
                return
            if ready:
                turn = pickle.loads(self._turns.recv())
                self._on_turn(turn)
                if turn.last:
                    return
            elif self.process.poll() is not None:
                self._on_exit(f"the engine process exited with code {self.process.returncode}")
                return

    def close(self, wait: bool = True, timeout: float = 30.0) -> None:
        """Wait for the process to end (after a Shutdown command), killing it after `timeout` seconds."""
        if wait:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop within %.0fs; killing it", timeout)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout=5)
        with self._send_lock:
            self._closed = True
            self._commands.close()
        self._turns.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _log_format() -> str | None:
    for handler in logging.getLogger().handlers:
        fmt = getattr(handler.formatter, "_fmt", None)
        if fmt:
            return fmt
    return None


def _portable(item: Any) -> Any:
    """An exception that cannot cross the socket becomes an EngineError with its text."""
    if not isinstance(item, BaseException):
        return item
    try:
        pickle.loads(pickle.dumps(item))
        return item
    except Exception:
        return EngineError(f"{type(item).__name__}: {item}")


# -- the child ----------------------------------------------------------------------------------------


def _import_config_machinery() -> None:
    """What the engine's start imports first whatever the settings say: transformers' configuration
    machinery (~0.7 s alone). A launched process does it while the front end imports the server, before its
    settings can come. Not `type_validators` (0.8 s more: it imports transformers' weight-loading and
    distributed modules): the config classes that need it (Llama's, not Qwen2's) import it themselves."""
    import transformers.configuration_utils  # noqa: F401
    from transformers import AutoConfig  # noqa: F401


def main(commands_address: str, turns_address: str, parent: int | None = None) -> int:
    """The engine process: `parent` the front end's pid (default: this process's parent now)."""
    import zmq

    from pagellm.engine.llm_engine import LLMEngine

    if threading.current_thread() is threading.main_thread():  # not so in some hosts (a Ray actor)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front end, which shuts us down
    parent = os.getppid() if parent is None else parent
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(commands_address)
    turns = context.socket(zmq.PUSH)
    turns.setsockopt(zmq.LINGER, 5000)
    turns.connect(turns_address)

    def parent_gone() -> bool:
        return os.getppid() != parent

    _import_config_machinery()
    while not commands.poll(_POLL_MS):  # launched early, the settings may take a while (or never come)
        if parent_gone():
            return 1
    start: _Start = pickle.loads(commands.recv())
    handler = logging.StreamHandler(sys.stderr)  # the front end's stderr: one log for both processes
    prefix = start.log_prefix.replace("%", "%%")
    handler.setFormatter(logging.Formatter(prefix + (start.log_format or logging.BASIC_FORMAT)))
    logger.addHandler(handler)
    logger.setLevel(start.log_level)
    logger.propagate = False

    def send(message: Any) -> None:
        turns.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def emit(turn: Turn) -> None:
        turn.items = [(request_id, _portable(item)) for request_id, item in turn.items]
        send(turn)

    receive = _receiver(commands, parent_gone)

    started = threading.Event()
    threading.Thread(
        target=_exit_if_orphaned_while_starting, args=(parent_gone, started), daemon=True
    ).start()
    try:
        engine = LLMEngine(start.config)
    except BaseException as exc:
        logger.debug("engine start-up failed", exc_info=True)
        send(_StartFailed(_portable(exc)))
        turns.close()
        context.term()
        return 1
    started.set()
    send(EngineFacts.of(engine))
    EngineCore(engine, emit).run(receive)
    engine.shutdown()
    # a gone front end reads nothing more: without linger 0 the last turns held the exit for LINGER's 5 s
    # (with the model's weights and KV cache still in memory)
    turns.close(linger=0 if parent_gone() else _FINAL_LINGER_MS)
    commands.close(linger=0)
    context.term()
    return 0


def _receiver(commands: Any, parent_gone: Callable[[], bool]) -> Callable[[bool | float], list[Command]]:
    """`EngineCore.run`'s receive on the commands socket: what has arrived; when idle, block for at least one
    (for up to `wait` seconds where it is a number); a Shutdown once the front end is gone."""

    def receive(wait: bool | float) -> list[Command]:
        received = []
        deadline = None if isinstance(wait, bool) else time.monotonic() + wait
        while True:
            timeout = _POLL_MS if wait and not received else 0
            if deadline is not None:
                timeout = max(0, min(timeout, int((deadline - time.monotonic()) * 1000)))
            if commands.poll(timeout):
                received.append(pickle.loads(commands.recv()))
                continue
            if received or not wait:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            if parent_gone():
                break
        if parent_gone():
            from pagellm.engine.core import Shutdown

            received.append(Shutdown("the front end is gone"))
        return received

    return receive


def _exit_if_orphaned_while_starting(parent_gone: Callable[[], bool], started: threading.Event) -> None:
    """Exit as soon as the front end is gone while the engine still loads or compiles (minutes of work
    nobody waits for: a server stopped during its start). Once it runs, its loop notices the same and shuts
    down in order."""
    while not started.wait(1.0):
        if parent_gone():
            os._exit(1)
