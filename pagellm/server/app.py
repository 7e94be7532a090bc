"""The OpenAI-, Anthropic- and Ollama-compatible FastAPI app over an AsyncLLM: `build_app` and its route table.

Each API family is served by a module of its own, on the shared `serving_base.ServingBase`:
serving_completion.py, serving_chat.py, serving_responses.py (the Responses API), serving_embedding.py,
serving_score.py (scores, reranking,
classification), anthropic.py (Anthropic's Messages API), serving_ollama.py and ollama_models.py
(Ollama's API) and serving_admin.py (health, version, metrics, models, tokenize, detokenize, LoRA adapters); the
middleware (API keys, body size) is middleware.py, the error bodies and their handlers errors.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagellm import __version__
from pagellm.engine.async_llm import AsyncLLM
from pagellm.server import errors
from pagellm.server.anthropic import MessagesResponse, ServingMessages
from pagellm.server.limits import DEFAULT_MAX_BODY_MB, DEFAULT_MAX_N
from pagellm.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware, OllamaJSONBodyMiddleware
from pagellm.server.ollama_models import OllamaModels
from pagellm.server.protocol import ChatCompletionResponse, CompletionResponse
from pagellm.server.protocol_ollama import OllamaChatResponse, OllamaGenerateResponse
from pagellm.server.protocol_responses import ResponseObject
from pagellm.server.serving_admin import ServingAdmin
from pagellm.server.serving_chat import ServingChat
from pagellm.server.serving_completion import ServingCompletion
from pagellm.server.serving_embedding import ServingEmbedding
from pagellm.server.serving_models import ServedModels
from pagellm.server.serving_ollama import ServingOllama, json_or_lines
from pagellm.server.serving_responses import ServingResponses
from pagellm.server.serving_score import ServingScore
from pagellm.server.web_ui import install_web_ui


def build_app(
    llm: AsyncLLM,
    served_model_names: Sequence[str],
    *,
    api_keys: Sequence[str] = (),
    chat_template: str | None = None,
    log_requests: bool = True,
    max_n: int = DEFAULT_MAX_N,
    max_body_bytes: int = DEFAULT_MAX_BODY_MB * 2**20,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
    responses_store: tuple[int, float] | None = None,
    web_ui: bool = False,
) -> FastAPI:
    """The app serving `llm` under `served_model_names` (the first is the default for requests naming none).

    With `api_keys`, every path but /health and /metrics needs `Authorization: Bearer <one of them>`. Bodies
    over `max_body_bytes` get 413, requests for more than `max_n` samples 400. `responses_store`: (most
    responses, seconds each) that /v1/responses keeps (--enable-responses-store); None keeps none. `web_ui`:
    the chat page at `/` (web_ui.py; `pagellm serve` turns it on unless --no-web-ui)."""
    models = ServedModels(llm, served_model_names)
    options: dict[str, Any] = {"chat_template": chat_template, "log_requests": log_requests, "max_n": max_n}
    tools = {"tool_call_parser": tool_call_parser, "enable_auto_tool_choice": enable_auto_tool_choice}
    admin = ServingAdmin(llm, models, **options)
    chat = ServingChat(llm, models, **tools, **options)
    messages = ServingMessages(llm, models, **tools, **options)
    completion = ServingCompletion(llm, models, **options)
    embedding = ServingEmbedding(llm, models, **options)
    scoring = ServingScore(llm, models, **options)
    ollama, ollama_models = ServingOllama(chat, embedding), OllamaModels(chat)
    for name, path in (lora_modules or {}).items():
        models.add_lora(name, path)

    app = FastAPI(title="pagellm", version=__version__, docs_url=None, redoc_url=None)
    errors.install_handlers(app)
    _add_middleware(app, api_keys, max_body_bytes, web_ui)

    keyed = errors.openapi_errors(401, 500)
    posted = errors.openapi_errors(400, 401, 404, 408, 413, 500, 503)
    health = {200: {"description": "The engine runs; the body is empty.", "content": None}}
    app.get("/health", response_class=Response, responses={**health, **errors.openapi_errors(503)})(
        admin.health
    )
    app.get("/version", responses=keyed)(admin.version)
    app.get("/metrics", response_class=PlainTextResponse)(admin.metrics)
    app.get("/v1/models", responses=keyed)(admin.models)
    app.post("/v1/completions", responses={**_json_or_events(CompletionResponse), **posted})(
        completion.completions
    )
    app.post("/v1/chat/completions", responses={**_json_or_events(ChatCompletionResponse), **posted})(
        chat.chat_completions
    )
    if allow_runtime_lora_updating:
        app.post("/v1/load_lora_adapter", responses=posted)(admin.load_lora_adapter)
        app.post("/v1/unload_lora_adapter", responses=posted)(admin.unload_lora_adapter)
    app.post("/tokenize", responses=posted)(admin.tokenize)
    app.post("/detokenize", responses=posted)(admin.detokenize)
    app.post("/v1/embeddings", responses=posted)(embedding.embeddings)
    _route_responses(app, ServingResponses(llm, models, store=responses_store, **tools, **options), posted)
    app.post("/v1/score", responses=posted)(scoring.score)
    for version in ("v1", "v2"):  # Jina's and Cohere's rerank paths
        app.post(f"/{version}/rerank", responses=posted, operation_id=f"rerank_{version}")(scoring.rerank)
    app.post("/classify", responses=posted)(scoring.classify)
    app.post("/pooling", responses=posted)(scoring.pooling)
    _route_messages(app, messages)
    ollama_failed = errors.openapi_errors(400, 401, 404, 408, 413, 500, 503, ollama=True)
    chat_lines = json_or_lines(OllamaChatResponse, "The reply, or its lines")
    app.post("/api/chat", responses={**chat_lines, **ollama_failed})(ollama.api_chat)
    generate_lines = json_or_lines(OllamaGenerateResponse, "The reply, or its lines")
    app.post("/api/generate", responses={**generate_lines, **ollama_failed})(ollama.api_generate)
    app.post("/api/embed", responses=ollama_failed)(ollama.api_embed)
    app.post("/api/show", responses=ollama_failed)(ollama_models.show)
    listed = errors.openapi_errors(401, 500, ollama=True)
    for path in ("tags", "ps", "version"):  # Ollama's model routes
        app.get(f"/api/{path}", responses=listed)(getattr(ollama_models, path))
    _document_400_not_422(app)
    return app


def _add_middleware(app: FastAPI, api_keys: Sequence[str], max_body_bytes: int, web_ui: bool) -> None:
    """The middleware, the last added running first: the chat page (`web_ui`) ahead of the API-key check, so
    the page loads without the key its API calls need; then Ollama's bodies, the body size, the key."""
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(OllamaJSONBodyMiddleware)
    if web_ui:
        install_web_ui(app)


def _route_responses(app: FastAPI, responses: ServingResponses, posted: dict[int | str, Any]) -> None:
    """OpenAI's Responses API: create, and (answering 404 while the store is off) retrieve and cancel."""
    response_or_events = _json_or_events(ResponseObject, "The response, or its events")
    app.post("/v1/responses", responses={**response_or_events, **posted})(responses.create)
    app.get("/v1/responses/{response_id}", responses=errors.openapi_errors(401, 404, 500))(responses.retrieve)
    cancelled = errors.openapi_errors(400, 401, 404, 413, 500)
    app.post("/v1/responses/{response_id}/cancel", responses=cancelled)(responses.cancel)


def _route_messages(app: FastAPI, messages: ServingMessages) -> None:
    """Anthropic's Messages API, its errors in Anthropic's body."""
    anthropic_failed = errors.openapi_errors(400, 401, 404, 408, 413, 500, 503, anthropic=True)
    message_or_events = _json_or_events(MessagesResponse, "The message, or its events")
    app.post("/v1/messages", responses={**message_or_events, **anthropic_failed})(messages.messages)
    app.post("/v1/messages/count_tokens", responses=anthropic_failed)(messages.count_tokens)


SERVER_SENT_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "One server-sent event: `data` holds a JSON chunk, or `[DONE]` at the end of an OpenAI stream.",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def _json_or_events(
    model: type[BaseModel], description: str = "The response, or its chunks as events"
) -> dict[int | str, dict[str, Any]]:
    """The 200 of an endpoint that answers JSON, or server-sent events with `"stream": true`.

    For an event stream OpenAPI 3.1 reads `schema` as the schema of one event, parsed into its fields (the JSON
    text sits in `data`); a plain string schema would call every parsed event a schema break.
    """
    events = {"text/event-stream": {"schema": SERVER_SENT_EVENT}}
    return {200: {"model": model, "description": description, "content": events}}


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents 422 for invalid bodies; this app answers them with 400 (as OpenAI does)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
