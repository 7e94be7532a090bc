"""The router's HTTP side: every POST that names a `model` in its JSON body (completions, chat, responses,
messages, embeddings, Ollama's /api/..., tokenize...) is proxied to that model's child, loaded first if
need be, and its answer streamed through as it comes. The router answers itself:

- `GET /v1/models` (and `GET /models`, llama-server's router path): every model, with `state` "loaded",
  "loading" or "unloaded";
- `POST /models/load` and `POST /models/unload` with `{"model": NAME}`, as llama-server's router mode;
- `GET /metrics`: each loaded child's metrics with a `model` label, and the router's own per model;
- `GET /api/tags` and `/api/ps` (Ollama's lists: every model; the loaded ones) and `GET /api/version`;
- `GET /health` (the router is up) and `GET /version`.

Errors have the body of the path's API (OpenAI's, Anthropic's under /v1/messages, Ollama's under /api/)
and name the field: 400 without `model`, 404 for a model not served, 503 when its server cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagellm.server.router.children import ChildStartError
from pagellm.server.router.prometheus import merge_metrics, router_metrics
from pagellm.server.router.registry import ModelRegistry, UnknownModelError
from pagellm.server.web_ui import install_web_ui

OPEN_PATHS = ("/health", "/metrics")  # answered without an API key, as by a single-model server
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
_KEPT_RESPONSE_HEADERS = ("content-type", "content-encoding", "retry-after", "x-request-id")


def error_response(
    status: int, message: str, path: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error in the body the path's clients parse (OpenAI's; Anthropic's; Ollama's), naming `param`."""
    if path.startswith("/api/"):
        body: dict[str, Any] = {"error": f"{param}: {message}" if param else message}
    elif path == "/v1/messages" or path.startswith("/v1/messages/"):
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "api_error"
        )
        body = {
            "type": "error",
            "error": {"type": kind, "message": f"{param}: {message}" if param else message},
        }
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    headers = {"Retry-After": "5"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def build_router_app(
    registry: ModelRegistry,
    api_keys: list[str] | None = None,
    timeout_s: float = 600.0,
    max_body_bytes: int = 16 * 2**20,
    web_ui: bool = False,
) -> FastAPI:
    """The router's ASGI app over `registry`; its lifespan starts the keep-alive reaper and, at the end,
    stops every child. `web_ui`: the chat page at `/` (pagellm/server/web_ui.py), which lists every model
    from /v1/models and loads one by naming it in a request."""
    proxy = _Proxy(registry, timeout_s, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start_reaper()
        try:
            yield
        finally:
            await registry.close()
            await proxy.client.aclose()

    app = FastAPI(title="pagellm model router", lifespan=lifespan)
    keys = [k.encode() for k in api_keys or [] if k]
    if keys:
        _require_keys(app, keys)
    if web_ui:
        install_web_ui(app)  # after the key check: the last added runs first, so the page needs no key

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "models": {s.spec.name: s.state for s in registry.slots.values()}}

    @app.get("/version")
    @app.get("/api/version")
    async def pagellm_version() -> dict:
        try:
            return {"version": version("pagellm")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": registry.describe()}

    @app.get("/api/tags")
    async def ollama_tags(raw: Request) -> dict:
        return {"models": await proxy.ollama_entries("/api/tags", raw, loaded_only=False)}

    @app.get("/api/ps")
    async def ollama_ps(raw: Request) -> dict:
        return {"models": await proxy.ollama_entries("/api/ps", raw, loaded_only=True)}

    @app.post("/models/load")
    async def load(raw: Request) -> Response:
        return await proxy.load_or_unload(raw, load=True)

    @app.post("/models/unload")
    async def unload(raw: Request) -> Response:
        return await proxy.load_or_unload(raw, load=False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await proxy.metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/{path:path}")
    async def forward(path: str, raw: Request) -> Response:
        return await proxy.forward(raw)

    return app


def _require_keys(app: FastAPI, keys: list[bytes]) -> None:
    """401 unless `Authorization: Bearer KEY` (or `x-api-key` under /v1/messages) carries a key; compared in
    constant time. The same keys are the children's, and the header is passed on to them."""

    @app.middleware("http")
    async def check_key(raw: Request, call_next):
        path = raw.url.path
        if path in OPEN_PATHS:
            return await call_next(raw)
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        given = [
            token.strip().encode() if scheme.lower() == "bearer" else b"",
            raw.headers.get("x-api-key", "").strip().encode(),
        ]
        match = False
        for key in keys:
            for candidate in given:
                match |= hmac.compare_digest(candidate, key)
        if not match:
            return error_response(
                401,
                "Missing or incorrect API key; send it as `Authorization: Bearer <key>`.",
                path,
                code="invalid_api_key",
            )
        return await call_next(raw)


class _Proxy:
    """What the routes share: the registry and one HTTP client to every child."""

    def __init__(self, registry: ModelRegistry, timeout_s: float, max_body_bytes: int):
        self.registry = registry
        self.max_body_bytes = max_body_bytes
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    def _model_of(self, body: Any, path: str) -> str | JSONResponse:
        """The model the body names (Ollama's older `name` too), or the error that says why there is none;
        with a single model, a body that names none goes to it."""
        model = None
        if isinstance(body, dict):
            model = body.get("model") or (body.get("name") if path.startswith("/api/") else None)
        if not model and len(self.registry.slots) == 1:
            return next(iter(self.registry.slots))
        if not isinstance(model, str) or not model:
            names = ", ".join(self.registry.slots)
            return error_response(
                400, f"name the model to use in `model` (one of: {names})", path, param="model"
            )
        if model not in self.registry.slots:
            return _not_found(model, path)
        return model

    async def forward(self, raw: Request) -> Response:
        """A POST for a model: to its server, loaded first (or waiting for the load under way)."""
        path = raw.url.path
        content = await self._read_body(raw)
        if content is None:
            message = f"The request body is larger than this server's limit of {self.max_body_bytes} bytes."
            return error_response(413, message + " (--max-request-body-mb)", path)
        try:
            body = json.loads(content) if content else {}
        except ValueError:
            return error_response(400, "the body is not JSON", path)
        model = self._model_of(body, path)
        if isinstance(model, Response):
            return model
        try:
            child = await self.registry.acquire(model)
        except ChildStartError as exc:
            return error_response(
                503,
                f"model `{model}` could not be loaded: {exc}",
                path,
                param="model",
                code="model_load_failed",
            )
        return await self._send(raw, model, child.url, content)

    async def _read_body(self, raw: Request) -> bytes | None:
        """The body, or None as soon as it outgrows --max-request-body-mb (the router reads a body whole to
        find its model, so an oversized one is cut off here rather than held)."""
        length = raw.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in raw.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def _send(self, raw: Request, model: str, base_url: str, content: bytes) -> Response:
        """The child's answer, streamed through as it comes; the model counts as in use until it ends."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() not in _HOP_HEADERS}
        url = base_url + raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
        request = self.client.build_request("POST", url, content=content, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            self.registry.release(model)
            return error_response(
                502, f"the server of model `{model}` cannot be reached: {exc}", raw.url.path, param="model"
            )
        kept = {k: v for k, v in response.headers.items() if k.lower() in _KEPT_RESPONSE_HEADERS}

        released = False

        async def done() -> None:
            """Once, whichever comes first: the body's end, or the client going away mid-stream (then the
            relay is closed, not finished, and the background task may never run)."""
            nonlocal released
            if not released:
                released = True
                self.registry.release(model)
                with contextlib.suppress(httpx.HTTPError):
                    await response.aclose()

        return StreamingResponse(
            _relay(response, done),
            status_code=response.status_code,
            headers=kept,
            background=BackgroundTask(done),
        )

    async def load_or_unload(self, raw: Request, load: bool) -> Response:
        """POST /models/load and /models/unload: {"model": NAME}."""
        path = raw.url.path
        try:
            body = await raw.json()
        except ValueError:
            return error_response(400, "the body is not JSON", path)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return error_response(400, "give the model to load or unload as `model`", path, param="model")
        model = body["model"]
        try:
            if load:
                await self.registry.load(model)
            else:
                await self.registry.unload(model)
        except UnknownModelError:
            return _not_found(model, path)
        except ChildStartError as exc:
            return error_response(
                503,
                f"model `{model}` could not be loaded: {exc}",
                path,
                param="model",
                code="model_load_failed",
            )
        return JSONResponse({"success": True, "model": model, "state": self.registry.slots[model].state})

    async def ollama_entries(self, path: str, raw: Request, loaded_only: bool) -> list[dict]:
        """Ollama's model lists (`ollama list`, `ollama ps`): each loaded model's entry as its own server
        gives it (size, details); with loaded_only False also an entry, without details, for each other."""
        headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "x-api-key")}
        entries = []
        for slot in self.registry.slots.values():
            entry = None
            if slot.child is not None:
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, IndexError):
                    response = await self.client.get(slot.child.url + path, headers=headers, timeout=5.0)
                    entry = response.json()["models"][0]
                if entry is not None and "expires_at" in entry and self.registry.keep_alive_s is not None:
                    entry["expires_at"] = _expiry(slot.last_used, self.registry.keep_alive_s)
            if entry is None and not loaded_only:
                name = slot.spec.name
                modified = datetime.fromtimestamp(slot.created, timezone.utc).isoformat()
                details = {"format": "", "family": "", "families": []}
                entry = {
                    "name": name,
                    "model": name,
                    "modified_at": modified,
                    "size": 0,
                    "digest": "",
                    "details": details,
                }
            if entry is not None:
                entries.append(entry)
        return entries

    async def metrics(self) -> str:
        """Each loaded child's /metrics, labelled with its model, then the router's own."""
        loaded = [(s.spec.name, s.child) for s in self.registry.slots.values() if s.child is not None]

        async def scrape(url: str) -> str:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.client.get(url + "/metrics", timeout=5.0)
                if response.status_code == 200:
                    return response.text
            return ""

        texts = await asyncio.gather(*(scrape(child.url) for _, child in loaded))
        merged = merge_metrics([(name, text) for (name, _), text in zip(loaded, texts, strict=True)])
        return merged + router_metrics(self.registry)


def _expiry(last_used: float, keep_alive_s: float) -> str:
    """When --keep-alive unloads a model last used at `last_used` (monotonic), as Ollama's `expires_at`."""
    remaining = max(0.0, last_used + keep_alive_s - time.monotonic())
    return datetime.fromtimestamp(time.time() + remaining, timezone.utc).isoformat().replace("+00:00", "Z")


def _not_found(model: str, path: str) -> JSONResponse:
    return error_response(
        404,
        f"The model `{model}` does not exist; GET /v1/models lists the served ones.",
        path,
        param="model",
        code="model_not_found",
    )


async def _relay(response: httpx.Response, done: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The child's body as it comes (server-sent events and Ollama's JSON lines each as soon as sent);
    closing the child's response when the client leaves aborts the request there too."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError:  # the child went away mid-answer: end the stream; the client sees it cut
        return
    finally:
        await done()
