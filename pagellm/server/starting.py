"""`StartingGate`: what the server answers while its engine starts.

`pagellm serve` listens from the start, so a load balancer's or supervisor's health check sees a server that
is starting (503 with the reason and `Retry-After`) rather than a refused or hanging connection for the
minute or more it takes to load and compile a model. Once the engine is up the gate hands every request to
the real app; if the start failed the server stops, with the reason, before anything is handed on.
"""

from __future__ import annotations

import logging
import threading
import time
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm.core.config import EngineConfig
from pagellm.engine.async_llm import AsyncLLM, EngineError
from pagellm.engine.process_launch import EngineLaunch
from pagellm.plugins.loader import load_plugins
from pagellm.server import errors
from pagellm.server.app import build_app

logger = logging.getLogger("pagellm")

RETRY_AFTER_S = 5


class StartingGate:
    """An ASGI app: 503 on every route until `open(app)`, then `app` itself."""

    def __init__(self, what: str):
        self.what = what
        self.started = time.monotonic()
        self.app: ASGIApp | None = None

    def open(self, app: ASGIApp) -> None:
        """Serve `app` from the next request on."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            path = scope["path"]
            await errors.error_response(self.starting(), path=path)(scope, receive, send)
        # a lifespan or websocket scope gets nothing until then: uvicorn serves lifespan="off"

    def starting(self) -> errors.APIError:
        elapsed = time.monotonic() - self.started
        return errors.APIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"starting: the engine is loading {self.what} ({elapsed:.0f} s so far); retry in a few seconds",
            type="service_unavailable",
            code="starting",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class EngineStarter(threading.Thread):
    """Starts the engine and builds the app while uvicorn already answers (through the gate), then opens the
    gate (adopting `launched`, the engine process `pagellm serve` launched first thing, where one engine
    process runs). A start that fails stops the server; `raise_failure` then raises what the start raised, as
    `pagellm serve` did when it started the engine before listening. Stopping the server while the engine
    still starts leaves it to the engine process, which exits when it sees the server gone."""

    def __init__(
        self,
        config: EngineConfig,
        names: list[str],
        app_options: dict[str, Any],
        gate: StartingGate,
        server: uvicorn.Server,
        launched: EngineLaunch | None = None,
    ) -> None:
        super().__init__(name="pagellm-engine-start", daemon=True)
        self.launched = launched
        self.config, self.names, self.app_options = config, names, app_options
        self.gate, self.server = gate, server
        self.llm: AsyncLLM | None = None
        self.failure: BaseException | None = None
        self._stopping = threading.Lock()

    def run(self) -> None:
        try:
            load_plugins()  # what the app needs, while the engine starts (0.2-0.4 s on two cores, else after)
            llm = AsyncLLM.from_config(self.config, launched=self.launched)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by raise_failure
            self.failure = exc
            self.server.should_exit = True
            return
        with self._stopping:
            self.llm = llm
            if self.server.should_exit:  # stopped while starting
                llm.shutdown()
                return
            try:
                app = build_app(llm, self.names, **self.app_options)
            except BaseException as exc:  # noqa: BLE001
                self.failure = exc
                self.server.should_exit = True
                return
            llm.on_engine_exit(lambda reason: setattr(self.server, "should_exit", True))
            self.gate.open(app)
        logger.info("serving %s", ", ".join(self.names))

    def stop(self) -> None:
        """Shut the engine down if it started (the server has stopped)."""
        with self._stopping:
            self.server.should_exit = True
            if self.llm is not None:
                self.llm.shutdown()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.llm is not None and self.llm.engine_failure is not None:
            # its requests were failed with the reason; a supervisor restarts us
            raise EngineError(f"the engine ended ({self.llm.engine_failure}); the server stopped")
