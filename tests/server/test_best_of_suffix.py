"""`best_of` and `suffix` on /v1/completions through the official openai client, in-process: best_of answers
the n samples with the highest cumulative logprob (usage counts them all); suffix builds a fill-in-the-middle
prompt from the tokenizer's own FIM tokens, or is a 400 naming it for a tokenizer without them."""

from __future__ import annotations

import openai
import pytest
from openai_asgi import call_app
from tiny import make_tiny_checkpoint, make_tokenizer

from pagellm import AsyncLLM
from pagellm.server.app import build_app
from pagellm.server.serving_base import fim_token_ids

QWEN_FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False, max_n=8)


def test_best_of_answers_the_n_likeliest_samples_and_counts_them_all(app):
    kwargs = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )

    async def work(client, http):
        every = await client.completions.create(n=4, logprobs=1, **kwargs)
        best = await client.completions.create(n=2, best_of=4, logprobs=1, **kwargs)
        plain = await client.completions.create(n=2, best_of=4, **kwargs)
        same = await client.completions.create(n=2, best_of=2, stream=True, **kwargs)
        return every, best, plain, [c async for c in same]

    every, best, plain, streamed = call_app(app, work)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in ranked[:2]] != [c.text for c in every.choices[:2]]  # so the ranking matters
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.logprobs.token_logprobs for c in best.choices] == [
        c.logprobs.token_logprobs for c in ranked[:2]
    ]
    assert best.usage.completion_tokens == every.usage.completion_tokens == 4 * 6
    assert [c.text for c in plain.choices] == [c.text for c in best.choices]
    assert all(c.logprobs is None for c in plain.choices)
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_best_of_errors_name_it(app):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}

    async def work(client, http):
        return [
            await http.post("/v1/completions", json={**body, **extra})
            for extra in (
                {"n": 3, "best_of": 2},
                {"best_of": 3, "stream": True},
                {"best_of": 9},
                {"best_of": 0},
            )
        ]

    for response in call_app(app, work):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "best_of", response.text


def test_the_fim_spelling_is_the_one_the_vocabulary_has():
    assert fim_token_ids(make_tokenizer()) is None
    for spelling in (["<fim_prefix>", "<fim_suffix>", "<fim_middle>"], QWEN_FIM):
        tokenizer = make_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": spelling[::-1]})
        assert fim_token_ids(tokenizer) == tuple(tokenizer.convert_tokens_to_ids(spelling))


@pytest.fixture(scope="module")
def fim_llm(tmp_path_factory):
    """The tiny model with a tokenizer that has Qwen2.5-Coder's FIM tokens (its vocabulary sized to fit)."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    model_dir = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fim"), vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model_dir)
    llm = AsyncLLM(str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=128, engine_process=False)
    yield llm
    llm.shutdown()


def test_suffix_makes_a_fill_in_the_middle_prompt(fim_llm, app, monkeypatch):
    seen = []
    add_request = fim_llm.add_request

    async def spy(prompt, *args, **kwargs):
        seen.append(prompt["prompt_token_ids"])
        return await add_request(prompt, *args, **kwargs)

    monkeypatch.setattr(fim_llm, "add_request", spy)
    fim_app = build_app(fim_llm, ["fim"], log_requests=False)
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"

    async def work(client, http):
        text = await client.completions.create(model="fim", prompt=prefix, suffix=suffix, max_tokens=4)
        ids = await client.completions.create(
            model="fim", prompt=[5, 6], suffix=suffix, max_tokens=4, echo=True
        )
        return text, ids

    text, ids = call_app(fim_app, work)
    tok = fim_llm.tokenizer
    pre, suf, mid = tok.convert_tokens_to_ids(QWEN_FIM)
    tail = [suf, *tok.encode(suffix, add_special_tokens=False), mid]
    assert seen == [[pre, *tok.encode(prefix, add_special_tokens=False), *tail], [pre, 5, 6, *tail]]
    assert text.usage.prompt_tokens == len(seen[0]) and text.choices[0].finish_reason in ("stop", "length")

    async def refused(client, http):
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(model="tiny", prompt=prefix, suffix=suffix, max_tokens=4)
        return error.value

    error = call_app(app, refused)
    assert error.body["param"] == "suffix" and "fill-in-the-middle" in error.body["message"]
