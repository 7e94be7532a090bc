"""The disaggregation proxy (`pagellm proxy`): each completion or chat completion goes first to a prefill
engine, as the same request with max_tokens 1, not streamed, and kv_transfer_params {"do_remote_decode":
true}; then to a decode engine with the kv_transfer_params the prefill engine returned, which tell it where
the prompt's KV is. The client gets the decode engine's answer as that engine sent it, streamed or whole;
the prefill engine's one token is dropped (the decode engine computes the first token itself, from the
prompt's last token, so its answer is the one a single engine gives).

A prefill engine that cannot be reached or fails (5xx) costs time only: the request goes to the decode
engine without kv_transfer_params and it computes the prompt itself. A request the prefill engine refuses
(4xx: too long, a bad field) gets that refusal. Requests for several samples (n, best_of, beam search) go
to a decode engine alone. Several --prefill and --decode URLs are used in turn.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger("pagellm")

_NOT_FOR_PREFILL = ("stream", "stream_options", "echo", "logprobs", "top_logprobs", "min_tokens")
_FORWARDED_HEADERS = ("authorization", "x-api-key")


def prefill_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill engine's request for `body`; None when it is not split (several samples)."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return None
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL and k != "max_completion_tokens"}
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return prefill


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0) -> FastAPI:
    """The proxy's ASGI app over these engines' base URLs (e.g. http://127.0.0.1:8100)."""
    proxy = _Proxy(prefill_urls, decode_urls, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(title="pagellm disaggregation proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.forward("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await proxy.forward("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await proxy.models(raw)

    @app.get("/health")
    async def health() -> Response:
        """200 when every engine answers /health with 200, else 503 naming those that do not."""
        return await proxy.health()

    return app


class _Proxy:
    """What the app's routes share: the engines, taken in turn, and one HTTP client to them all (closed
    with the app)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float):
        self.prefill_urls, self.decode_urls = prefill_urls, decode_urls
        self.prefills = itertools.cycle([u.rstrip("/") for u in prefill_urls])
        self.decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response | dict | None:
        """The prefill engine's kv_transfer_params, None when it failed, or its refusal to pass on."""
        url = next(self.prefills) + path
        try:
            response = await self.client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            logger.warning("prefill engine %s failed (%s); the decode engine computes the prompt", url, exc)
            return None
        if 400 <= response.status_code < 500:
            return Response(response.content, response.status_code, media_type="application/json")
        if response.status_code != 200:
            logger.warning(
                "prefill engine %s answered %d; the decode engine computes the prompt",
                url,
                response.status_code,
            )
            return None
        return response.json().get("kv_transfer_params")

    async def forward(self, path: str, raw: Request) -> Response:
        """A completion or chat completion: prefilled where it splits, then the decode engine's answer,
        streamed through as it comes or whole."""
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        headers = _forwarded_headers(raw)
        if prefill_body(body) is not None:
            params = await self.prefill(path, body, headers)
            if isinstance(params, Response):
                return params
            if params:
                body = {**body, "kv_transfer_params": params}
        url = next(self.decodes) + path
        client = self.client
        try:
            response = await client.send(
                client.build_request("POST", url, json=body, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            return _error(502, f"the decode engine {url} cannot be reached: {exc}")
        media_type = response.headers.get("content-type")
        if body.get("stream") and response.status_code == 200:
            return StreamingResponse(
                response.aiter_raw(), media_type=media_type, background=BackgroundTask(response.aclose)
            )
        content = await response.aread()
        await response.aclose()
        return Response(content, response.status_code, media_type=media_type)

    async def models(self, raw: Request) -> Response:
        """A decode engine's model list."""
        headers = _forwarded_headers(raw)
        try:
            response = await self.client.get(next(self.decodes) + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"the decode engine cannot be reached: {exc}")
        return Response(response.content, response.status_code, media_type="application/json")

    async def health(self) -> Response:
        down = []
        for url in sorted(set(self.prefill_urls) | set(self.decode_urls)):
            try:
                if (await self.client.get(url.rstrip("/") + "/health", timeout=5.0)).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        return JSONResponse({"down": down}, status_code=503 if down else 200)


def _forwarded_headers(raw: Request) -> dict[str, str]:
    """The client's credentials, passed on to the engines."""
    return {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "proxy_error", "code": status}}, status_code=status
    )
