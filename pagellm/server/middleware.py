"""The ASGI middleware in front of every endpoint: API keys (`--api-key`), the body size limit
(`--max-request-body-mb`) and Ollama's bodies read as JSON. The first two answer with the error body of
the path's API (errors.py) before any endpoint runs."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.server import errors

OPEN_PATHS = ("/health", "/metrics")  # answered without an API key


class APIKeyMiddleware:
    """401 unless the request carries one of the keys; keys are compared in constant time."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        await errors.error_response(errors.invalid_api_key(path), path=path)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer KEY`; on Anthropic's paths also `x-api-key: KEY`, as its clients send."""
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = [token.strip().encode() if scheme.lower() == "bearer" else b""]
        if errors.is_anthropic(scope["path"]):
            given.append(headers.get("x-api-key", "").strip().encode())
        match = False
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            for candidate in given:
                match |= hmac.compare_digest(candidate, key)
        return match


class OllamaJSONBodyMiddleware:
    """Ollama's clients and its docs' `curl -d` post JSON without saying so (no Content-Type, or curl's
    form type), and Ollama reads it anyway: bodies posted under /api/ are read as JSON whatever they say."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and errors.is_ollama(scope["path"]):
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once when its Content-Length says so, or as soon as a chunked body
    grows past it, so an oversized body is never read whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = errors.body_too_large(self.max_bytes)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await errors.error_response(too_large, path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI lets an HTTPException from reading the body through
                raise StarletteHTTPException(too_large.status, too_large.info.message)
            return message

        await self.app(scope, receive_limited, send)
