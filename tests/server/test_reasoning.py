"""Reasoning parsers: the split of a reply into thinking and answer, the same streamed (under every
chunking, with tags split across chunks) as whole; a missing start tag; the chat endpoint's `reasoning`
field; and a grammar that waits for the end of the reasoning."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pagellm import AsyncLLM
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.server.app import build_app
from pagellm.server.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningStream

TEXTS = [
    "<think>Let me add 2 and 2.</think>The answer is 4.",
    "Let me add 2 and 2.</think>The answer is 4.",  # DeepSeek-R1: the prompt opened <think>
    "<think>still thinking when max_tokens hit",
    "No thinking at all.",
    "<think></think>",
    "<think>a < b and c </ d, not </thinking> yet</think> done </think> twice",
    "<thi",
    "",
]
EXPECTED = {
    "deepseek_r1": [
        ("Let me add 2 and 2.", "The answer is 4."),
        ("Let me add 2 and 2.", "The answer is 4."),
        ("still thinking when max_tokens hit", ""),
        ("No thinking at all.", ""),
        ("", ""),
        ("a < b and c </ d, not </thinking> yet", " done </think> twice"),
        ("<thi", ""),
        ("", ""),
    ],
    "qwen3": [
        ("Let me add 2 and 2.", "The answer is 4."),
        ("", "Let me add 2 and 2.</think>The answer is 4."),
        ("still thinking when max_tokens hit", ""),
        ("", "No thinking at all."),
        ("", ""),
        ("a < b and c </ d, not </thinking> yet", " done </think> twice"),
        ("", "<thi"),
        ("", ""),
    ],
}
PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser(), "qwen3": Qwen3ReasoningParser()}


@pytest.mark.parametrize("name", list(PARSERS))
def test_whole_replies_split_as_expected(name):
    assert [PARSERS[name].split(t, final=True) for t in TEXTS] == EXPECTED[name]


def _chunkings(text: str, seed: int):
    """Whole, per token of the tiny tokenizer, per character, and at random cuts."""
    from tiny import make_tokenizer

    yield [text]
    spans = make_tokenizer()(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    cuts = sorted({b for _, b in spans if 0 < b < len(text)})
    yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    yield list(text)  # per character: every tag split across chunks
    rng = random.Random(seed)
    for _ in range(20):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
            if len(text) > 1
            else []
        )
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("name", list(PARSERS))
def test_streamed_pieces_concatenate_to_the_whole_split_under_every_chunking(name):
    parser = PARSERS[name]
    for i, text in enumerate(TEXTS):
        whole = parser.split(text, final=True)
        for chunks in _chunkings(text, i):
            stream = ReasoningStream(parser)
            pieces = [stream.feed(c, final=j == len(chunks) - 1) for j, c in enumerate(chunks)]
            assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == whole, (text, chunks)


def test_a_partial_tag_is_held_back_until_it_is_known():
    stream = ReasoningStream(DeepSeekR1ReasoningParser())
    assert stream.feed("<think>abc</th") == ("abc", "")
    assert stream.feed("ink>de") == ("", "de")
    stream = ReasoningStream(Qwen3ReasoningParser())
    assert stream.feed("<th") == ("", "")  # may still be the start tag
    assert stream.feed("e end", final=True) == ("", "<the end")


def test_an_unknown_reasoning_parser_is_refused_with_the_known_ones(tmp_path):
    from pagellm.engine.setup import reasoning_parser
    from pagellm.plugins.loader import load_plugins

    with pytest.raises(ConfigError, match="deepseek_r1, openai_gptoss, qwen3"):
        reasoning_parser(load_plugins(), "r2d2")
    assert EngineConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"


@pytest.fixture(scope="module")
def reasoning_app(tiny_model_dir):
    llm = AsyncLLM(
        str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=128, engine_process=False,
        reasoning_parser="deepseek_r1",
    )  # fmt: skip
    yield build_app(llm, ["tiny"], log_requests=False)
    llm.shutdown()


def test_chat_replies_carry_reasoning_streamed_and_whole_alike(reasoning_app):
    """A random model never closes its thinking: with deepseek_r1 the whole reply is reasoning."""

    async def run():
        transport = httpx.ASGITransport(app=reasoning_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            body = {
                "model": "tiny", "max_tokens": 12, "temperature": 0,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                    {"role": "user", "content": "2 + 2?"},
                ],
            }  # fmt: skip
            whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
            deltas = [
                json.loads(line[6:])["choices"][0]["delta"]
                for line in streamed.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]
            ]
            return whole, deltas

    whole, deltas = asyncio.run(run())
    assert whole["reasoning"] and whole["content"] is None
    assert "".join(d.get("reasoning", "") for d in deltas) == whole["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == ""


def test_a_grammar_waits_for_the_end_of_the_reasoning():
    """RequestGrammar with `start_after`: no mask while thinking, drafts cut where the thinking ends, the
    grammar's mask from the next token on."""
    from concurrent.futures import Future

    import xgrammar as xgr
    from tiny import make_tokenizer

    from pagellm.structured_output.grammar import RequestGrammar

    tokenizer = make_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled: Future = Future()
    compiled.set_result(xgr.GrammarCompiler(info).compile_regex("[0-9]+"))
    end = tokenizer.encode("</think>", add_special_tokens=False)
    grammar = RequestGrammar(compiled, len(tokenizer), start_after=end)
    thinking = tokenizer.encode("hmm let me see", add_special_tokens=False)
    assert grammar.bitmask([]) is None
    drafts = thinking[-2:] + end + thinking[:3]
    assert grammar.valid_prefix(drafts) == thinking[-2:] + end  # up to the end of the thinking
    grammar.accept(thinking + end[:-1])
    assert grammar.bitmask([]) is None and not grammar.active
    digits = tokenizer.encode("42", add_special_tokens=False)
    grammar.accept([end[-1], *digits])  # the thinking ends; the digits go to the grammar
    assert grammar.active
    mask = grammar.bitmask([])
    allowed = [t for t in range(len(tokenizer)) if (mask[0, t // 32] >> (t % 32)) & 1]
    assert allowed and all(tokenizer.decode([t]).isdigit() or t in (0, 1, 2) for t in allowed)
