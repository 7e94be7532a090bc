"""A Responses API request's `input` as chat messages, and a response's output as the assistant's turn, so
that `/v1/responses` renders its prompt with the same chat template as `/v1/chat/completions`.

Input items: messages (a string, or `input_text`, `input_image` and, from earlier assistant turns,
`output_text` parts), `function_call` (consecutive ones become one assistant turn with several calls),
`function_call_output` (a `tool` turn) and `reasoning` (the thinking of the assistant turn that follows).
Anything else is a 400 naming the item.
"""

from __future__ import annotations

from typing import Any

from pagellm.server import errors
from pagellm.server.protocol import valid_unicode
from pagellm.server.protocol_responses import FunctionCallItem, MessageItem, OutputItem, ReasoningItem

_ROLES = ("user", "assistant", "system", "developer")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; 400 naming `input[i]` for an item it cannot take."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    for i, item in enumerate(items):
        field = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            thinking.append(_reasoning_text(item))
            continue
        if kind == "message":
            message = {"role": _role(item, field), "content": _content(item.get("content"), field)}
        elif kind == "function_call":
            message = _call_turn(messages, item, field)
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _text_of(item, "call_id", field)}
            message["content"] = _output_text(item.get("output"), field)
        else:
            raise errors.bad_request(
                f"{field} is of type {kind!r}; input items may be message, function_call, "
                "function_call_output or reasoning",
                "input",
            )
        if message["role"] == "assistant" and thinking:
            message["reasoning_content"] = "\n".join(thinking)
            thinking = []
        if message is not (messages[-1] if messages else None):
            messages.append(message)
    return messages


def assistant_turn(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up request continues from."""
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if isinstance(item, ReasoningItem):
            turn["reasoning_content"] = "\n".join(c.text for c in item.content)
        elif isinstance(item, MessageItem):
            turn["content"] = "".join(c.text for c in item.content)
        elif isinstance(item, FunctionCallItem):
            call = {"name": item.name, "arguments": item.arguments}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
    return [turn] if len(turn) > 2 or turn["content"] is not None else []


def _role(item: dict[str, Any], field: str) -> str:
    role = item.get("role")
    if role not in _ROLES:
        raise errors.bad_request(f"{field}.role must be one of {', '.join(_ROLES)}, got {role!r}", "input")
    return role


def _content(content: Any, field: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or text and image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request(f"{field}.content must be a string or a list of parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{field}.content[{j}]"
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _text_of(part, "text", where)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise errors.bad_request(
                    f"{where} needs an image_url (an http(s) or data: URL); file_id is not supported", "input"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise errors.bad_request(
                f"{where} is of type {kind!r}; parts may be input_text, input_image or output_text "
                "(input_file and refusal are not supported)",
                "input",
            )
    return parts


def _call_turn(messages: list[dict[str, Any]], item: dict[str, Any], field: str) -> dict[str, Any]:
    """The assistant turn a function_call item belongs to: the previous one when it only called tools."""
    call = {
        "id": _text_of(item, "call_id", field),
        "type": "function",
        "function": {"name": _text_of(item, "name", field), "arguments": _text_of(item, "arguments", field)},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
        last["tool_calls"].append(call)
        return last
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _output_text(output: Any, field: str) -> str:
    """A function_call_output's output: a string, or the text of its input_text parts."""
    if isinstance(output, str):
        return _unicode(output, f"{field}.output")
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") == "input_text" for p in output
    ):
        return _unicode("".join(str(p.get("text", "")) for p in output), f"{field}.output")
    raise errors.bad_request(f"{field}.output must be a string or a list of input_text parts", "input")


def _reasoning_text(item: dict[str, Any]) -> str:
    """The text of a reasoning item: its reasoning_text content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    parts = parts if isinstance(parts, list) else []
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def _text_of(item: dict[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise errors.bad_request(f"{field}.{key} must be a string", "input")
    return _unicode(value, f"{field}.{key}")


def _unicode(text: str, field: str) -> str:
    try:
        return valid_unicode(text)
    except ValueError as exc:
        raise errors.bad_request(f"{field} {exc}", "input") from exc
