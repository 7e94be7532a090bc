"""GPT-OSS's harmony replies through the reasoning parser `openai_gptoss` and the tool-call parser `openai`:
the split and the calls of realistic replies (thinking, calls in both header orders, several calls,
preambles, built-in tools, replies cut anywhere, no harmony at all), the same streamed under every split
point as whole, alone and composed as the server composes them, and no marker ever in what they return."""

from __future__ import annotations

import functools
import random

import pytest
from tool_call_deltas import gather_tool_call_deltas

from pagellm.core.parsers import reads_special_tokens, reads_whole_reply
from pagellm.plugins.loader import load_plugins
from pagellm.server import harmony
from pagellm.server.reasoning import GptOssReasoningParser, ReasoningStream
from pagellm.server.serving_chat import ReplyStream
from pagellm.server.tool_parsers import OpenAIToolParser, ToolCallStream

ANALYSIS = "<|channel|>analysis<|message|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
# (reply as the server decodes it, with special tokens; its reasoning; its content; its calls). A reply
# that ends with <|return|> or <|call|> ends on a stop token, which the text leaves out.
REPLIES = [
    (
        f"{ANALYSIS}The user asks for 2 + 2. Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.",
        "The user asks for 2 + 2. Simple.",
        "2 + 2 = 4.",
        [],
    ),
    (
        f"{ANALYSIS}Need the weather: call get_weather.<|end|>"
        + CALL.format("get_weather")
        + '{"city": "Paris", "days": 2}',
        "Need the weather: call get_weather.",
        "",
        [("get_weather", '{"city": "Paris", "days": 2}')],
    ),
    (  # the recipient before the channel, two calls, <|call|> kept between them
        f"{ANALYSIS}Two lookups.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        '<|start|>assistant to=functions.add<|channel|>commentary <|constrain|>json<|message|> {"a": 1, "b": 2}\n'
        "<|call|>",
        "Two lookups.",
        "",
        [("get_weather", '{"city": "Oslo"}'), ("add", '{"a": 1, "b": 2}')],
    ),
    (  # a preamble on the commentary channel is for the user
        "<|channel|>commentary<|message|>Let me check the weather.<|end|>"
        + CALL.format("get_weather")
        + '{"city": "Rome"}',
        "",
        "Let me check the weather.",
        [("get_weather", '{"city": "Rome"}')],
    ),
    (  # the prompt ended with <|start|>assistant: the reply may open with the recipient
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lima"}',
        "",
        "",
        [("get_weather", '{"city": "Lima"}')],
    ),
    (  # max_tokens hit inside a call's arguments
        f"{ANALYSIS}Hmm.<|end|>" + CALL.format("get_weather") + '{"city": "Ro',
        "Hmm.",
        "",
        [("get_weather", '{"city": "Ro')],
    ),
    (f"{ANALYSIS}Hmm.<|end|><|start|>assistant<|channel|>comm", "Hmm.", "", []),  # ... inside a header
    (f"{ANALYSIS}still thinking when max_tokens hit", "still thinking when max_tokens hit", "", []),
    (  # a built-in tool's call is neither thinking nor a function call
        f"{ANALYSIS}Search first.<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "harmony"}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>Found it.",
        "Search first.",
        "Found it.",
        [],
    ),
    (
        f"{ANALYSIS}First.<|end|><|start|>assistant{ANALYSIS}Second.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.",
        "First.\nSecond.",
        "Done.",
        [],
    ),
    (CALL.format("ping")[len("<|start|>assistant") :], "", "", [("ping", "{}")]),  # no arguments
    ("Just an answer, with a < sign, <|x and to=x.", "", "Just an answer, with a < sign, <|x and to=x.", []),
    ("<|channel|>final<|message|>Almost<|ret", "", "Almost<|ret", []),  # a partial marker at the very end
    ("", "", "", []),
]
REASONING, TOOLS = GptOssReasoningParser(), OpenAIToolParser()


@functools.cache
def _tokenizer():
    from tiny import HARMONY_SPECIAL_TOKENS, make_tokenizer

    return make_tokenizer(special_tokens=HARMONY_SPECIAL_TOKENS)


def _cut(text: str, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _random_chunkings(text: str, seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        k = min(len(text) - 1, rng.randint(1, 8))
        yield _cut(text, sorted(rng.sample(range(1, len(text)), k)) if k > 0 else [])


def _chunkings(text: str, seed: int):
    """Whole; cut once at every split point; per character; per token of the tiny GPT-OSS tokenizer (a
    marker one token, as the server decodes it); at random cuts."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)
    spans = _tokenizer()(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    yield _cut(text, sorted({b for _, b in spans if 0 < b < len(text)}))
    yield from _random_chunkings(text, seed, 10)


def test_the_parsers_are_registered_and_read_special_tokens():
    registry = load_plugins()
    assert registry.reasoning_parsers["openai_gptoss"] is GptOssReasoningParser
    assert registry.tool_parsers["openai"] is OpenAIToolParser
    assert reads_special_tokens(REASONING) and reads_special_tokens(TOOLS) and reads_whole_reply(TOOLS)


@pytest.mark.parametrize("i", range(len(REPLIES)))
def test_whole_replies_split_and_call_as_expected(i):
    text, reasoning, content, calls = REPLIES[i]
    assert REASONING.split(text) == (reasoning, content)
    parsed = TOOLS.parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize("i", range(len(REPLIES)))
def test_streamed_pieces_concatenate_to_the_whole_reply_under_every_chunking(i):
    """Each parser alone, and both as the server composes them (`ReplyStream`: the reasoning from the
    reasoning parser, the answer and the calls from the tool parser, which reads the whole reply)."""
    text, reasoning, content, calls = REPLIES[i]
    for chunks in _chunkings(text, i):
        last = len(chunks) - 1
        split = ReasoningStream(REASONING)
        pieces = [split.feed(c, final=j == last) for j, c in enumerate(chunks)]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content), chunks

        tool_stream, got, answer = ToolCallStream(TOOLS, "x"), {}, ""
        for j, c in enumerate(chunks):
            piece, deltas = tool_stream.feed(c, final=j == last)
            answer += piece
            gather_tool_call_deltas(deltas, got)
        assert (answer, [tuple(c) for c in got.values()]) == (content, calls), chunks

        reply, got, thinking, answer = ReplyStream(REASONING, TOOLS, "x"), {}, "", ""
        for j, c in enumerate(chunks):
            r, piece, deltas = reply.feed(c, final=j == last)
            thinking, answer = thinking + r, answer + piece
            gather_tool_call_deltas(deltas, got)
        assert (thinking, answer, [tuple(c) for c in got.values()]) == (reasoning, content, calls), chunks


def test_partial_markers_and_headers_wait_until_they_are_known():
    stream = ReasoningStream(REASONING)
    assert stream.feed(f"{ANALYSIS}abc<|e") == ("abc", "")
    assert stream.feed("nd|><|start|>assistant<|channel|>fin") == ("", "")
    assert stream.feed("al<|message|>4<") == ("", "4")
    assert stream.feed("", final=True) == ("", "<")
    calls = ToolCallStream(TOOLS, "x")
    assert calls.feed(" to") == ("", [])  # maybe the recipient, opening the reply
    assert calls.feed("=functions.f<|channel|>commentary json") == ("", [])  # the header is not complete
    (first,) = calls.feed('<|message|>{"a": 1} ')[1]
    assert first["function"] == {"name": "f", "arguments": '{"a": 1}'}  # trailing whitespace waits
    assert calls.feed("\n", final=True) == ("", [])
    stream = ReasoningStream(REASONING)
    assert stream.feed(" to") == ("", "")
    assert stream.feed("day", final=True) == ("", " today")  # not a header after all: the answer


def test_no_marker_ever_reaches_the_reasoning_or_the_content():
    """Random runs of markers, header words and text (what a model that has not learnt harmony, or a cut
    reply, may produce): streamed as whole, and never a marker in what the parsers return."""
    words = [
        *harmony.MARKERS,
        "analysis",
        "final",
        "commentary",
        " to=functions.f",
        "json",
        "hi",
        " ",
        "<",
        "<|",
    ]
    rng = random.Random(0)
    texts = ["".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(80)]
    # the parts of a marker around one: a body must not join them
    texts += ["<|channel|>final<|message|>a<|<|message|>end|>b", "x<|<|start|>y<|end|>end|>"]
    for i, text in enumerate(texts):
        reasoning, content = REASONING.split(text)
        parsed = TOOLS.parse(text)
        returned = [reasoning, content, parsed.content, *(a for _, a in parsed.calls)]
        assert not any(m in r for m in harmony.MARKERS for r in returned), text
        for chunks in (list(text), *_random_chunkings(text, i, 3)):
            reply, got, thinking, answer = ReplyStream(REASONING, TOOLS, "x"), {}, "", ""
            for j, c in enumerate(chunks):
                r, piece, deltas = reply.feed(c, final=j == len(chunks) - 1)
                thinking, answer = thinking + r, answer + piece
                gather_tool_call_deltas(deltas, got)
            streamed = (thinking, answer, [tuple(c) for c in got.values()])
            assert streamed == (reasoning, parsed.content, parsed.calls), chunks
