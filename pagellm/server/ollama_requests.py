"""Ollama's requests as the OpenAI ones the chat and completion paths serve: `options` onto sampling fields,
`format` onto a response format, base64 `images` onto image parts, and a refusal's field named the way
the Ollama request spells it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pagellm.server import errors
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.server.protocol_ollama import (
    Format,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
)

# the OpenAI field a refusal names -> the Ollama field the request gave
OLLAMA_FIELDS = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "response_format": "format",
    "tool_choice": "tools",
}
# Ollama's sampling options pagellm does not have, and the value that means "off" for each
_OFF = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "repeat_last_n": -1}


def ollama_field(param: str | None) -> str | None:
    return OLLAMA_FIELDS.get(param or "", param)


def sampling_fields(options: OllamaOptions | None, format: Format, stream: bool) -> dict[str, Any]:
    """The OpenAI request fields of Ollama's `options` and `format`; 400 naming an option that asks for
    sampling pagellm does not do (mirostat, tail-free, typical, a repeat window)."""
    options = options or OllamaOptions()
    for name, off in _OFF.items():
        value = getattr(options, name)
        if value is not None and value != off:
            raise errors.bad_request(
                f"pagellm does not do {name} sampling; leave it out or set it to {off}"
                + (" (repeat_penalty covers the whole prompt and output)" if name == "repeat_last_n" else ""),
                f"options.{name}",
            )
    fields: dict[str, Any] = {"stream": stream, "stop": options.stop}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(options, name)
        if value is not None:
            fields[name] = value
    if options.repeat_penalty is not None:
        fields["repetition_penalty"] = options.repeat_penalty
    if options.num_predict is not None and options.num_predict >= 0:
        fields["max_tokens"] = options.num_predict  # -1 and -2: up to the context
    if format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(format, dict):
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": format},
        }
    return fields


def openai_message(message: OllamaMessage) -> dict[str, Any]:
    """An Ollama message as an OpenAI chat message: images as image parts, a tool's name, the thinking as
    reasoning, tool calls as OpenAI's (arguments stay objects, as chat templates read them)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        parts = [{"type": "text", "text": message.content}] if message.content else []
        parts += [{"type": "image_url", "image_url": {"url": _data_url(image)}} for image in message.images]
        out["content"] = parts
    if message.tool_name is not None:
        out["name"] = message.tool_name
    if message.thinking:
        out["reasoning"] = message.thinking
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": dict(call.get("function") or {})}
            for i, call in enumerate(message.tool_calls)
        ]
    return out


def chat_request(body: OllamaChatRequest) -> ChatCompletionRequest:
    """/api/chat as a chat completions request."""
    _refuse_think(body.think)
    if not body.messages:
        raise errors.bad_request("messages is empty; give at least one message", "messages")
    fields = sampling_fields(body.options, body.format, body.stream)
    fields["messages"] = [openai_message(m) for m in body.messages]
    if body.tools:
        fields["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return _validated(ChatCompletionRequest, fields, "messages")


def generate_chat_request(body: OllamaGenerateRequest) -> ChatCompletionRequest:
    """/api/generate without `raw`: the prompt (and `system`, and `images`) through the chat template, as
    Ollama renders it through the model's template."""
    _refuse_think(body.think)
    messages = [OllamaMessage(role="system", content=body.system)] if body.system else []
    messages.append(OllamaMessage(role="user", content=body.prompt or "", images=body.images))
    fields = sampling_fields(body.options, body.format, body.stream)
    fields["messages"] = [openai_message(m) for m in messages]
    return _validated(ChatCompletionRequest, fields, "prompt")


def completion_request(body: OllamaGenerateRequest) -> CompletionRequest:
    """/api/generate with `raw` (or a `suffix`: fill in the middle): the prompt as it is."""
    _refuse_think(body.think)
    if body.images:
        raise errors.bad_request("images need the chat template: leave raw unset", "images")
    if body.system:
        raise errors.bad_request("system needs the chat template: leave raw unset", "system")
    fields = sampling_fields(body.options, body.format, body.stream)
    fields.update(prompt=body.prompt or "", suffix=body.suffix, max_tokens=fields.get("max_tokens"))
    return _validated(CompletionRequest, fields, "prompt")


def _refuse_think(think: bool | str | None) -> None:
    if think is not None:
        raise errors.bad_request(
            "pagellm does not switch a model's thinking per request; leave think out (a server started with "
            "--reasoning-parser answers the thinking in `thinking`)",
            "think",
        )


def _validated(model: type, fields: dict[str, Any], field: str) -> Any:
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = str(first["loc"][0]) if first.get("loc") else field
        raise errors.bad_request(f"{first.get('msg')}", ollama_field(where) or field) from exc


def _data_url(image: str) -> str:
    """Ollama sends an image as bare base64; the image loader reads it as a data URL (the bytes say the
    format, whatever the URL's type)."""
    return image if image.startswith("data:") else f"data:image/png;base64,{image}"
