"""Reasoning parsers: split a reply into its thinking and its answer (`--reasoning-parser NAME`).

A parser implements `pagellm.core.parsers.ReasoningParser` (a `name`, an `end_tag` and `split(text,
final)`) and is registered through the `pagellm_reasoning_parsers` plugin hook like every other plugin
kind (ours included, via this module's entry point). `split` is a function of the whole text so far: streaming calls it after each delta and
sends what grew, holding back a tail that may still become a tag, so the streamed pieces concatenate to
exactly the non-streamed split.
"""

from __future__ import annotations

from typing import ClassVar

from pagellm.core.parsers import ReasoningParser
from pagellm.plugins import hookimpl
from pagellm.server import harmony

PAGELLM_PLUGIN_API = "1.1"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkTagParser(ReasoningParser):
    """Thinking between `<think>` and `</think>`, the answer after."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    start_tag_required: ClassVar[bool] = True  # no start tag: no thinking, all answer

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of `text`; unless `final`, a tail that may be the start of a tag is left
        out of both (it is not known yet where it belongs)."""
        if text.startswith(self.start_tag):
            body = text[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(text):
            return "", ""  # maybe the start tag, still arriving
        elif self.start_tag_required:
            return "", text
        else:
            body = text
        end = body.find(self.end_tag)
        if end >= 0:
            return body[:end], body[end + len(self.end_tag) :]
        hold = 0 if final else _partial_tag_len(body, self.end_tag)
        return body[: len(body) - hold], ""


class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1: its chat template opens `<think>` in the prompt, so the reply may start inside the
    thinking without the tag; everything before `</think>` is thinking."""

    name = "deepseek_r1"
    start_tag_required = False


class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3: thinking only when the reply opens with `<think>` (thinking can be switched off)."""

    name = "qwen3"


class GptOssReasoningParser(ReasoningParser):
    """GPT-OSS (vLLM's `openai_gptoss`): the harmony analysis channel is the thinking, the rest of the
    reply that addresses no tool (the final channel) the answer; a call to a tool is neither (the `openai`
    tool-call parser reads it from the whole reply). A reply without harmony's markers is all answer."""

    name: ClassVar[str] = "openai_gptoss"
    end_tag: ClassVar[str] = "<|channel|>final<|message|>"
    reads_special_tokens: ClassVar[bool] = True  # the markers are special tokens

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        found = harmony.messages(text, final)
        thinking = "\n".join(m.body for m in found if m.channel == "analysis" and m.recipient is None)
        return thinking, harmony.answer(found)


class ReasoningStream:
    """One streamed reply: feed it each text delta, get (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self._sent = ("", "")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        sent_reasoning, sent_content = self._sent
        self._sent = (reasoning, content)
        return reasoning[len(sent_reasoning) :], content[len(sent_content) :]


@hookimpl
def pagellm_reasoning_parsers() -> list[type[ReasoningParser]]:
    return [DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser]
