"""OpenAI's error body ({"error": {"message", "type", "param", "code"}}) and the exception handlers that answer
with it: 400 names the invalid field, 401 for API keys, 404 for unknown models, 413 for oversized bodies, 503
with Retry-After when the queue is full (--max-waiting-requests), 500 for failures (with an id to find the details in the server log, never the exception itself). Under
/v1/messages the same errors take Anthropic's body ({"type": "error", "error": {"type", "message"}}), which
is what Anthropic's clients parse; under /api/ Ollama's ({"error": "..."})."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.core.errors import ConfigError
from pagellm.engine.async_llm import EngineError, OverloadedError, RequestTimeoutError
from pagellm.server.protocol import AnthropicErrorInfo, AnthropicErrorResponse, ErrorInfo, ErrorResponse
from pagellm.server.protocol_ollama import OllamaErrorResponse

logger = logging.getLogger("pagellm")

ANTHROPIC_PATH = "/v1/messages"  # it and the paths under it speak Anthropic's Messages API
OLLAMA_PATH = "/api/"  # the paths under it speak Ollama's API
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error the server answers with a given status and OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(
        HTTPStatus.NOT_FOUND,
        f"The model `{model}` does not exist; GET /v1/models lists the served ones.",
        param="model",
        code="model_not_found",
    )


def invalid_api_key(path: str = "") -> APIError:
    header = "`Authorization: Bearer <key>`"
    if is_anthropic(path):
        header += " or `x-api-key: <key>`"
    return APIError(
        HTTPStatus.UNAUTHORIZED,
        f"Missing or incorrect API key; send it as the header {header}.",
        code="invalid_api_key",
    )


def body_too_large(max_bytes: int) -> APIError:
    return APIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"The request body is larger than this server's limit of {max_bytes} bytes (--max-request-body-mb).",
    )


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def is_ollama(path: str) -> bool:
    """Ollama's API (serving_ollama.py) lives under /api/ and answers errors as {"error": "..."}."""
    return path.startswith(OLLAMA_PATH)


def ollama_error(error: APIError) -> OllamaErrorResponse:
    """Ollama's body is one message: it names the field, as Anthropic's does."""
    info = error.info
    message = info.message
    if info.param and info.param not in message:
        message = f"{info.param}: {message}"
    return OllamaErrorResponse(error=message)


def anthropic_error(error: APIError) -> AnthropicErrorResponse:
    """Anthropic's body has no `param`: the message names the field instead."""
    info = error.info
    message = info.message
    if info.param and info.param not in message:
        message = f"{info.param}: {message}"
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=message))


def error_response(error: APIError, headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error's body in the shape the request's path speaks (OpenAI's, or Anthropic's)."""
    body = anthropic_error(error) if is_anthropic(path) else ErrorResponse(error=error.info)
    if is_ollama(path):
        body = ollama_error(error)
    return JSONResponse(
        body.model_dump(), status_code=error.status, headers={**error.headers, **(headers or {})}
    )


def from_exception(exc: Exception, param: str | None = None) -> APIError:
    """The APIError an exception becomes: invalid input 400, anything else 500. An unexpected exception is
    logged under a fresh id and only the id goes to the client: its text may reveal the server's insides."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTimeoutError):
        return APIError(HTTPStatus.REQUEST_TIMEOUT, str(exc), type="timeout_error")
    if isinstance(exc, OverloadedError):
        headers = {"Retry-After": str(exc.retry_after_s)}
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type="overloaded_error", headers=headers)
    if isinstance(exc, (ConfigError, ValueError)):
        return bad_request(str(exc), param)
    if isinstance(exc, EngineError):  # its message is written for clients; the engine logged the cause
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), type="server_error")
    error_id = f"error-{uuid.uuid4().hex}"
    logger.error("%s: request failed", error_id, exc_info=exc)
    return APIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"Internal server error; the server log has the details under {error_id}.",
        type="server_error",
    )


def openapi_errors(
    *statuses: int, anthropic: bool = False, ollama: bool = False
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` documenting error statuses with the body they carry."""
    model = AnthropicErrorResponse if anthropic else OllamaErrorResponse if ollama else ErrorResponse
    return {status: {"model": model, "description": HTTPStatus(status).phrase} for status in statuses}


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = next((e for e in errors if len(e.get("loc", ())) > 1), None)
        param = str(first["loc"][1]) if first else None
        message = "; ".join(_describe(e) for e in errors) or "invalid request body"
        return error_response(bad_request(message, param), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail))
        return error_response(error, headers=exc.headers, path=request.url.path)  # 405: Allow

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(from_exception(exc), path=request.url.path)

    # anything else: Starlette answers with this body, then re-raises so the server logs the traceback
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(from_exception(exc), path=request.url.path)


def _describe(error: dict) -> str:
    where = ".".join(str(part) for part in error.get("loc", ())[1:])
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))
