"""Child `pagellm serve` processes, one per loaded model: started on a free localhost port, ready once their
/health answers 200, stopped with their whole process group (the child's engine process included), so
that unloading a model gives all of its memory back."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import httpx

logger = logging.getLogger("pagellm")

STOP_GRACE_S = 20.0
"""How long a child may take to finish its in-flight requests and exit after SIGTERM before it is killed."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ModelSpec:
    """One model the router serves: the name requests give as `model`, and what `pagellm serve` loads."""

    name: str
    path: str


class ChildStartError(RuntimeError):
    """A child did not become ready: it exited, or its /health did not answer 200 in time."""


class Child(Protocol):
    """A started model server, as the registry sees it."""

    url: str
    pid: int

    def alive(self) -> bool: ...

    async def stop(self) -> None: ...


class Launcher(Protocol):
    """Starts a ready child for a model (raising ChildStartError when it cannot)."""

    async def start(self, model: ModelSpec) -> Child: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the child binds it a moment later; a clash fails its start, clearly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError):
        return ctypes.CDLL(None, use_errno=True)
    return None


_LIBC = _libc() if sys.platform == "linux" else None  # loaded here: no dlopen between fork and exec


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the router dies, even by SIGKILL, so no orphaned model keeps
    its memory (Linux; elsewhere the router's own shutdown is what stops children). The signal follows the
    thread that forked, which is the router's event loop thread, alive as long as the router."""
    if _LIBC is not None:
        with contextlib.suppress(AttributeError):
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServeProcess:
    """One child `pagellm serve`, in a session (and process group) of its own, so stop() reaches its engine
    process too."""

    def __init__(self, process: subprocess.Popen, url: str):
        self.process = process
        self.pid = process.pid
        self.url = url

    def alive(self) -> bool:
        return self.process.poll() is None

    async def stop(self) -> None:
        """SIGTERM to the group (the child finishes what is in flight), SIGKILL to what is left after
        STOP_GRACE_S, and wait for the child, so its memory is free when this returns."""
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("model server pid %d did not exit in %.0fs; killing it", self.pid, STOP_GRACE_S)
        self._signal_group(signal.SIGKILL)  # the child's own children, should any outlive it
        self.process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class SubprocessLauncher:
    """Starts `pagellm serve PATH --port P --served-model-name NAME SERVE_ARGS...` with this Python.

    `serve_args` are the router's own serve options (engine flags and all) that every child inherits;
    `env` is added to this process's environment (the API keys, so a child answers only key holders)."""

    def __init__(
        self,
        serve_args: list[str],
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
        log_level: str = "WARNING",
    ):
        self.serve_args = list(serve_args)
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level

    def command(self, model: ModelSpec, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pagellm.cli",
            "--log-level",
            self.log_level,
            "serve",
            *([model.path] if model.path else []),  # none: the embedded model
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            model.name,
            *self.serve_args,
        ]

    async def start(self, model: ModelSpec) -> ServeProcess:
        port = free_port()
        logger.info("loading model %r (%s) on 127.0.0.1:%d", model.name, model.path, port)
        process = subprocess.Popen(
            self.command(model, port),
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if _LIBC is not None else None,  # prctl only
        )
        child = ServeProcess(process, f"http://127.0.0.1:{port}")
        try:
            await self._wait_ready(model, child)
        except BaseException:  # a failed start, or a cancelled one (the router shutting down)
            await child.stop()
            raise
        return child

    async def _wait_ready(self, model: ModelSpec, child: ServeProcess) -> None:
        """Poll the child's /health until it answers 200 (it answers 503 while its engine starts)."""
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                code = child.process.poll()
                if code is not None:
                    raise ChildStartError(
                        f"the server of model {model.name!r} exited with status {code} while starting "
                        "(its log is in the router's log, above)"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(child.url + "/health")).status_code == 200:
                        logger.info("model %r ready in %.1fs", model.name, time.monotonic() - started)
                        return
                if time.monotonic() - started > self.start_timeout_s:
                    raise ChildStartError(
                        f"the server of model {model.name!r} did not become ready in "
                        f"{self.start_timeout_s:.0f}s"
                    )
                await asyncio.sleep(0.2)
