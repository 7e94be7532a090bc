"""The engine core in a process of its own, for `AsyncLLM`: the front end (tokenizer, HTTP, streams) and
the engine (model, scheduler, detokenizer) no longer share one interpreter.

Why: torch ops on a second Python thread get an OpenMP team of their own, and on a small machine that
team and the main thread's compete; the same steps ran 20-40% slower on the engine thread than on the
main thread. A process runs the engine on its main thread, the way `LLM` does, and keeps the front end's
Python (JSON, SSE, tokenizing chat templates) off the cores the engine steps on.

The front end binds two ZeroMQ sockets in a private directory and starts a Python child that runs
`main(DIR)`: commands go down one socket, pickled, and every `Turn` comes back on
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
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.core.config import EngineConfig
from pagellm.engine.core import Command, EngineCore, EngineError, Turn
from pagellm.engine.scheduler import SchedulerStats
from pagellm.sampling.params import SamplingParams

logger = logging.getLogger("pagellm")

_POLL_MS = 200


@dataclass
class EngineFacts:
    """What the front end needs to know of the engine, sent once it is ready."""

    max_model_len: int
    kv_cache_tokens: int
    default_params: SamplingParams
    tokenizer_path: str
    scheduler_stats: SchedulerStats

    @classmethod
    def of(cls, engine: Any) -> EngineFacts:
        return cls(
            max_model_len=engine.max_model_len,
            kv_cache_tokens=engine.scheduler.kv_cache_manager.capacity_tokens,
            default_params=engine.default_sampling_params(),
            tokenizer_path=engine.setup.config.tokenizer or engine.setup.source.directory,
            scheduler_stats=engine.stats(),
        )


@dataclass
class _Start:
    config: EngineConfig
    log_level: int
    log_format: str | None


@dataclass
class _StartFailed:
    error: BaseException


class EngineProcess:
    """Starts the engine process for `config` and waits until it is ready (raising what its start-up
    raised). `on_turn` runs on a receiver thread for every turn; `on_exit(reason)` once, if the process
    ends without a last turn."""

    def __init__(
        self,
        config: EngineConfig,
        on_turn: Callable[[Turn], None],
        on_exit: Callable[[str], None],
    ):
        import zmq

        self._on_turn = on_turn
        self._on_exit = on_exit
        self._dir = tempfile.mkdtemp(prefix="pagellm-engine-")
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._turns = self._context.socket(zmq.PULL)
        self._turns.setsockopt(zmq.LINGER, 0)
        self._turns.bind(f"ipc://{self._dir}/turns")
        self._send_lock = threading.Lock()
        self._closed = False
        self.process = subprocess.Popen([sys.executable, "-c", _CHILD, self._dir])
        try:
            self._send(_Start(config, logger.getEffectiveLevel(), _log_format()))
            self.facts = self._wait_ready()
        except BaseException:
            self.close(wait=False)
            raise
        self._receiver = threading.Thread(target=self._receive, name="pagellm-engine-receiver", daemon=True)
        self._receiver.start()

    @property
    def is_alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def send(self, command: Command) -> None:
        self._send(command)

    def _send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if not self._closed:
                self._commands.send(data)

    def _wait_ready(self) -> EngineFacts:
        while True:
            if self._turns.poll(_POLL_MS):
                message = pickle.loads(self._turns.recv())
                if isinstance(message, _StartFailed):
                    raise message.error
                return message
            code = self.process.poll()
            if code is not None:
                raise EngineError(
                    f"the engine process exited with code {code} while starting; its log says why"
                )

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


def main(directory: str) -> int:
    import zmq

    from pagellm.engine.llm_engine import LLMEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front end, which shuts us down
    parent = os.getppid()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(f"ipc://{directory}/commands")
    turns = context.socket(zmq.PUSH)
    turns.setsockopt(zmq.LINGER, 5000)
    turns.connect(f"ipc://{directory}/turns")
    start: _Start = pickle.loads(commands.recv())
    handler = logging.StreamHandler(sys.stderr)  # the front end's stderr: one log for both processes
    handler.setFormatter(logging.Formatter(start.log_format or logging.BASIC_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(start.log_level)
    logger.propagate = False

    def parent_gone() -> bool:
        return os.getppid() != parent

    def send(message: Any) -> None:
        turns.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def emit(turn: Turn) -> None:
        turn.items = [(request_id, _portable(item)) for request_id, item in turn.items]
        send(turn)

    def receive(wait: bool) -> list[Command]:
        received = []
        while True:
            if commands.poll(_POLL_MS if wait and not received else 0):
                received.append(pickle.loads(commands.recv()))
                continue
            if received or not wait:
                break
            if parent_gone():
                break
        if parent_gone():
            from pagellm.engine.core import Shutdown

            received.append(Shutdown("the front end is gone"))
        return received

    try:
        engine = LLMEngine(start.config)
    except BaseException as exc:
        logger.debug("engine start-up failed", exc_info=True)
        send(_StartFailed(_portable(exc)))
        turns.close()
        context.term()
        return 1
    send(EngineFacts.of(engine))
    EngineCore(engine, emit).run(receive)
    turns.close()
    commands.close(linger=0)
    context.term()
    return 0


_CHILD = "import sys; from pagellm.engine.core_process import main; sys.exit(main(sys.argv[1]))"
"""The child's program: `main` imported by the module's own name (not run as __main__), so the classes
it pickles unpickle in the front end."""
