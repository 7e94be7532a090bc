"""The two parser plugin kinds the server uses on a chat reply: `ToolParser` (`--tool-call-parser NAME`,
the `pagellm_tool_parsers` hook) and `ReasoningParser` (`--reasoning-parser NAME`,
`pagellm_reasoning_parsers`).

Both are Protocols: a plugin's class needs the members, not this module, so parsers written for plugin
API 1.1 before it existed keep working; ours subclass them to say what they are. The loader checks each
class a parser hook returns with `check_parser` (a class, with the string attributes and the method) and
skips a plugin whose class is not one, naming what it lacks.

A parser is a function of the whole reply so far: the server parses again after each streamed delta and
sends what grew, so unless `final` a parser holds back what may still change (a tail that may become a
tag), and the streamed pieces concatenate to exactly the whole reply's parse. The registry holds the
classes; the server makes one instance of each with no arguments.

Two optional class attributes (False when absent, so older parsers need neither) change what a parser
is given, for formats whose markers are special tokens and whose calls sit beside the thinking (GPT-OSS's
harmony): `reads_special_tokens` (either kind) has the server decode the reply with its special tokens
kept (a request's `skip_special_tokens` is overridden; the parsers keep the markers out of what they
return), and `reads_whole_reply` (a tool parser) has it parse the whole reply, thinking included, instead
of the reasoning parser's answer; its content then replaces that answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass
class ToolCallParse:
    """What a tool-call parser found in a reply (so far)."""

    content: str  # the text that is not a call
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON text)


@runtime_checkable
class ToolParser(Protocol):
    """Finds the function calls in a chat reply (see `pagellm.server.tool_parsers.HermesToolParser`)."""

    name: ClassVar[str]  # what users pass to --tool-call-parser

    def parse(self, text: str, final: bool = True) -> ToolCallParse:
        """The content and the (name, arguments JSON text) calls of the reply so far; a call's name once it
        is complete, its arguments as the model's own JSON text (whitespace at the end held back unless
        `final`)."""
        ...


@runtime_checkable
class ReasoningParser(Protocol):
    """Splits a reply into its thinking and its answer (see `pagellm.server.reasoning.ThinkTagParser`)."""

    name: ClassVar[str]  # what users pass to --reasoning-parser
    end_tag: ClassVar[str]  # the text that ends the thinking: a grammar applies after it

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the reply so far; unless `final`, a tail that may still become a tag is
        left out of both."""
        ...


def reads_special_tokens(parser: ToolParser | ReasoningParser | None) -> bool:
    """Whether `parser` reads the reply with its special tokens (see the module's docstring)."""
    return bool(getattr(parser, "reads_special_tokens", False))


def reads_whole_reply(parser: ToolParser | None) -> bool:
    """Whether tool parser `parser` reads the whole reply rather than the reasoning parser's answer."""
    return bool(getattr(parser, "reads_whole_reply", False))


# what a class must have to be each kind: its string attributes, then its methods
_MEMBERS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    ToolParser: (("name",), ("parse",)),
    ReasoningParser: (("name", "end_tag"), ("split",)),
}


def check_parser(cls: Any, kind: type[ToolParser] | type[ReasoningParser]) -> None:
    """TypeError naming what `cls` lacks to be a `kind` class (registries hold classes, not instances)."""
    if not isinstance(cls, type):
        raise TypeError(f"{cls!r} is not a class; return the {kind.__name__} classes, not instances")
    strings, methods = _MEMBERS[kind]
    missing = [f"a str attribute {s!r}" for s in strings if not isinstance(getattr(cls, s, None), str)]
    missing += [f"a method {m}()" for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} is not a {kind.__name__}: it needs {' and '.join(missing)} "
            f"(see pagellm.core.parsers.{kind.__name__})"
        )
