"""Tool-call parsers: find the function calls in a chat reply (`--tool-call-parser NAME`).

A parser implements `pagellm.core.parsers.ToolParser` (a `name` and `parse(text, final) ->
ToolCallParse`) and is registered through the `pagellm_tool_parsers` plugin hook (ours through this
module's entry point). Like the reasoning parsers, `parse` is a function of the whole reply so far: a
streamed reply is parsed again after each delta and the server sends what grew (a call's name once it is
complete, then its arguments as raw text), so the pieces concatenate to exactly the whole reply's parse.
Arguments are the model's own JSON text for the value of "arguments"/"parameters" (whitespace at the end
held back until the call closes).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from pagellm.core.parsers import ToolCallParse, ToolParser
from pagellm.plugins import hookimpl
from pagellm.server import harmony

PAGELLM_PLUGIN_API = "1.1"

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value that starts at text[start], or None if it is not complete yet."""
    opener = text[start : start + 1]
    if opener in ("{", "["):
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        return None
    if opener == '"':
        escaped = False
        for i in range(start + 1, len(text)):
            if escaped:
                escaped = False
            elif text[i] == "\\":
                escaped = True
            elif text[i] == '"':
                return i + 1
        return None
    match = re.compile(r"[^,}\]\s]*").match(text, start)  # a number, true, false or null
    end = match.end()
    return end if end < len(text) else None


def json_objects(text: str) -> list[tuple[int, int | None]]:
    """Spans (start, end) of the top-level JSON objects in `text` (end None for one still open); braces
    inside their strings do not count."""
    spans: list[tuple[int, int | None]] = []
    at = text.find("{")
    while at >= 0:
        end = _value_end(text, at)
        spans.append((at, end))
        if end is None:
            break
        at = text.find("{", end)
    return spans


def call_from_object(obj: str, closed: bool, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments) of one call object's text so far; None until its name is complete. The
    arguments are the raw text of the value (so far; whitespace at its end held back)."""
    name = _NAME.search(obj)
    if name is None:
        return None
    keys = "|".join(args_keys)
    match = re.search(rf'"(?:{keys})"\s*:\s*', obj)
    if match is None:
        args = "{}" if closed else ""
    else:
        end = _value_end(obj, match.end())
        args = obj[match.end() : end] if end is not None else obj[match.end() :].rstrip()
    return json.loads(f'"{name.group(1)}"'), args


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""

    name: ClassVar[str] = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        first = text.find(self.start)
        if first < 0:
            hold = 0 if final else _partial(text, self.start)
            return ToolCallParse(text[: len(text) - hold])
        result = ToolCallParse(text[:first])
        at = first
        while at >= 0:  # each call: the first JSON object after a start tag (string-aware, so a tag
            body = text[at + len(self.start) :]  # inside an argument is only text)
            spans = json_objects(body)
            if not spans:
                break
            start, stop = spans[0]
            call = call_from_object(body[start:stop], stop is not None, ("arguments",))
            if call is not None:
                result.calls.append(call)
            if stop is None:
                break
            at = text.find(self.start, at + len(self.start) + stop)
        return result


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
    `<|python_tag|>`, several separated by `;`. A reply that does not open with one is all content."""

    name: ClassVar[str] = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        body = text.lstrip()
        tagged = body.startswith(self.tag)
        if tagged:  # calls follow, whatever comes
            body = body[len(self.tag) :].lstrip()
        elif not final and self.tag.startswith(body):  # nothing yet, or maybe the tag arriving
            return ToolCallParse("")
        elif not body.startswith("{"):
            return ToolCallParse(text)
        result = ToolCallParse("")
        for start, stop in json_objects(body):
            call = call_from_object(body[start:stop], stop is not None, ("parameters", "arguments"))
            if call is not None:
                result.calls.append(call)
        return result


class OpenAIToolParser(ToolParser):
    """GPT-OSS's harmony calls (vLLM's `openai`): each message addressed `to=functions.NAME` (commentary
    channel) is a call, its body the arguments' JSON text; any number. It reads the whole reply, thinking
    included, since the calls sit beside the thinking rather than in the answer; its content is the
    answer (the final channel), so the analysis channel never shows there."""

    name: ClassVar[str] = "openai"
    reads_special_tokens: ClassVar[bool] = True  # the markers are special tokens
    reads_whole_reply: ClassVar[bool] = True
    prefix = "functions."

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        found = harmony.messages(text, final)
        calls = [
            (m.recipient[len(self.prefix) :], m.body.strip() or ("{}" if m.closed or final else ""))
            for m in found
            if m.recipient is not None and m.recipient.startswith(self.prefix)
        ]
        return ToolCallParse(harmony.answer(found), calls)


class RequiredToolParser(ToolParser):
    """tool_choice "required": the grammar made the reply a JSON array of {"name", "parameters"}."""

    name: ClassVar[str] = "required"

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        result = ToolCallParse("")
        for start, stop in json_objects(text):
            call = call_from_object(text[start:stop], stop is not None, ("parameters",))
            if call is not None:
                result.calls.append(call)
        return result


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the grammar made the whole reply its arguments."""

    name: ClassVar[str] = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        return ToolCallParse("", [(self.function, text.strip() if final else text.lstrip().rstrip())])


class ToolCallStream:
    """One streamed reply: feed it each text delta, get the content delta and the tool-call deltas in
    OpenAI's chunk format (a call's first delta: index, id, type and name; then argument fragments)."""

    def __init__(self, parser: ToolParser, id_prefix: str):
        self.parser = parser
        self.id_prefix = id_prefix
        self.text = ""
        self.last = ToolCallParse("")

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        deltas = []
        for i, (name, args) in enumerate(parsed.calls):
            if i < len(self.last.calls):
                sent = self.last.calls[i][1]
                if len(args) > len(sent):
                    deltas.append({"index": i, "function": {"arguments": args[len(sent) :]}})
            else:
                function = {"name": name, "arguments": args}
                deltas.append(
                    {"index": i, "id": call_id(self.id_prefix, i), "type": "function", "function": function}
                )
        content = parsed.content[len(self.last.content) :]
        self.last = parsed
        return content, deltas


def call_id(prefix: str, index: int) -> str:
    return f"call_{prefix[-20:]}_{index}"


def tool_choice_schema(tools: list[dict], choice: str | dict, parallel: bool) -> dict:
    """The JSON schema a reply must follow for tool_choice "required" (an array of calls) or a named
    function (its arguments). `tools` are OpenAI function definitions ({"name", "parameters", ...})."""
    if isinstance(choice, dict):
        function = next(t for t in tools if t["name"] == choice["function"]["name"])
        return function.get("parameters") or {"type": "object"}
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["name"]]},
                "parameters": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@hookimpl
def pagellm_tool_parsers() -> list[type[ToolParser]]:
    return [HermesToolParser, Llama3JsonToolParser, OpenAIToolParser]
