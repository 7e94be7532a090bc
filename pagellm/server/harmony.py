"""GPT-OSS's harmony format, read from a reply's text: the messages it holds, for the reasoning parser
`openai_gptoss` and the tool-call parser `openai`.

A harmony reply is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`. The
header names the channel (analysis: the thinking; commentary: tool calls and preambles; final: the
answer) and, for a tool call, the recipient (`to=functions.NAME`, before or after the channel, the
arguments' type after `<|constrain|>`). `<|end|>`, `<|call|>` and `<|return|>` close a body, as does the
next header. The chat template's prompt ends with `<|start|>assistant`, so a reply opens inside its first
header; a reply that opens with other text is not harmony, and that text is one message on no channel.

The markers are special tokens: the parsers that read them say so (`reads_special_tokens`) and the
server keeps special tokens in their text. Like every parser, `messages` is a function of the whole reply
so far: a message appears once its header is complete and its body only grows (a tail that may still
become a marker waits), so what the parsers derive from it grows the same way streamed or whole.

The format is read here from the text rather than by the `openai-harmony` package: that package loads its
`o200k_base` vocabulary by downloading it at run time (an offline server fails to start a parser) and parses
only that vocabulary's token ids, not those of whatever tokenizer a served checkpoint has. `forced_calls_tag`
writes the same format as an xgrammar structural tag, for tool calls a request forces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CLOSERS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class Message:
    """One message of a reply (so far)."""

    channel: str | None  # analysis, commentary, final; None for a header without one or a non-harmony reply
    recipient: str | None  # whom it addresses: "functions.NAME" for a call of the request's tools
    body: str
    closed: bool = False


def messages(text: str, final: bool = True) -> list[Message]:
    """The messages of `text`; unless `final`, a tail that may still become a marker is left out, and a
    reply that may still open with a header (` to=...`) holds no message yet."""
    if not final:
        text = text[: len(text) - _partial_marker_len(text)]
    opening = text.lstrip()
    found: list[Message] = []
    body: Message | None = None  # the message whose body is being read; None while reading a header
    if not (opening.startswith(MARKERS) or opening.startswith("to=")):
        if not final and "to=".startswith(opening):
            return found  # maybe a header that names its recipient first, still arriving
        body = Message(None, None, "")
        found.append(body)
    header, pos = "", 0
    for match in _MARKER.finditer(text):
        piece, marker, pos = text[pos : match.start()], match.group(), match.end()
        if body is not None:
            body.body += piece
            body.closed, body = True, None
            if marker == "<|message|>":  # a stray one inside a body: the next body, under the same header
                body = Message(found[-1].channel, found[-1].recipient, "")
                found.append(body)
                continue
            header = ""
        else:
            header += piece
        if marker == "<|message|>":
            channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
            body = Message(channel and channel.group(1), recipient and recipient.group(1), "")
            found.append(body)
        elif marker in _CLOSERS or marker == "<|start|>":
            header = ""
        else:  # <|channel|> or <|constrain|>: part of the header
            header += marker
    if body is not None:
        body.body += text[pos:]
    return found


def answer(found: list[Message]) -> str:
    """The reply's text for the user: every message that is neither thinking nor addressed to a tool (the
    final channel, commentary preambles, text outside harmony)."""
    return "\n".join(m.body for m in found if m.recipient is None and m.channel != "analysis")


def forced_calls_tag(functions: list[dict], only: str | None, parallel: bool) -> dict:
    """The xgrammar structural tag of a harmony reply that must call a function (tool_choice "required", or
    once `only` that one): an optional analysis message, then the calls, each a commentary message
    `to=functions.NAME` whose body follows the function's parameter schema. A call has no end marker of its
    own: `<|call|>` is a stop token of GPT-OSS, so the reply ends after the arguments (or, with `parallel`,
    `<|call|><|start|>assistant` and the next call, for a model that does not stop there). The thinking
    may not hold markers, so nothing it says is mistaken for a message."""
    analysis = {
        "type": "tag",
        "begin": "<|channel|>analysis<|message|>",
        "content": {"type": "any_text", "excludes": [m for m in MARKERS if m != "<|end|>"]},
        "end": "<|end|>",
    }
    calls = []
    for function in functions:
        if only is not None and function["name"] != only:
            continue
        arguments = {
            "type": "json_schema",
            "json_schema": function.get("parameters") or {"type": "object"},
            "max_whitespace_cnt": 1,  # compact: calls need no layout, and a model may loop on whitespace
        }
        name = function["name"]
        for begin in (  # the recipient after the channel (as GPT-OSS writes it) or before it
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
            f" to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>",
        ):
            calls.append({"type": "tag", "begin": begin, "content": arguments, "end": ""})
    thinking = {
        "type": "sequence",
        "elements": [analysis, {"type": "const_string", "value": "<|start|>assistant"}],
    }
    called = {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": "<|call|><|start|>assistant",
        "at_least_one": True,
        "stop_after_first": only is not None or not parallel,
    }
    return {
        "type": "structural_tag",
        "format": {"type": "sequence", "elements": [{"type": "optional", "content": thinking}, called]},
    }


def _partial_marker_len(text: str) -> int:
    """Length of the longest end of `text` that is a proper start of a marker (0 if none)."""
    longest = 0
    for marker in MARKERS:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
