"""Beam search: `LLM.beam_search` and /v1/completions with `use_beam_search` equal transformers'
`generate(num_beams=W, num_return_sequences=W)` (float32, same length penalty and early-stopping rule) on
prompts of several lengths, and the prefix cache serves the beams' shared tokens.

The tiny model's EOS row of the LM head is scaled up so that EOS is among the best candidates at some steps
but not all: beams then end both by EOS and at max_tokens, which is where the length penalty and the
early-stopping rules decide the answer.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from openai_asgi import call_app
from tiny import EOS_ID, make_tiny_checkpoint

from pagellm import LLM, AsyncLLM, BeamSearchParams
from pagellm.engine.processor import PromptTooLongError
from pagellm.server.app import build_app

MAX_TOKENS = 12
BLOCK_SIZE = 16
PROMPT_LENGTHS = (1, 3, 7, 17, 30, 45)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("beam"))
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"][EOS_ID] *= 2  # EOS the best candidate in about one context of ten
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=128, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def prompts(hf):
    rng = random.Random(1)
    return [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


_REFERENCES: dict[tuple, tuple[list[list[int]], list[float]]] = {}


@torch.no_grad()
def reference(hf, prompt, width, length_penalty=1.0, early_stopping=False, ignore_eos=False):
    """transformers' beams (generated tokens, cut after EOS) and scores, best first."""
    key = (id(hf), tuple(prompt), width, length_penalty, early_stopping, ignore_eos)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(hf, prompt, width, length_penalty, early_stopping, ignore_eos)
    return _REFERENCES[key]


def _reference(hf, prompt, width, length_penalty, early_stopping, ignore_eos):
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        return_dict_in_generate=True,
        output_scores=True,
        **({"eos_token_id": [10**6]} if ignore_eos else {}),  # an id no step produces: no beam ends early
    )
    beams = []
    for row in out.sequences[:, len(prompt) :].tolist():
        beams.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row and not ignore_eos else row)
    return beams, out.sequences_scores.tolist()


def assert_equal_to_transformers(hf, llm, prompts, **kwargs):
    params = BeamSearchParams(beam_width=kwargs.pop("width"), max_tokens=MAX_TOKENS, **kwargs)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    reasons = set()
    for prompt, output in zip(prompts, outputs, strict=True):
        theirs, scores = reference(hf, prompt, params.beam_width, **kwargs)
        ours = [s.output_token_ids for s in output.sequences]
        assert ours == theirs, f"prompt of {len(prompt)} tokens, {params}"
        for seq, score in zip(output.sequences, scores, strict=True):
            assert seq.tokens[: len(prompt)] == prompt
            assert seq.score == pytest.approx(score, abs=1e-4)
            generated = len(seq.output_token_ids)
            assert seq.cum_logprob / generated**params.length_penalty == pytest.approx(seq.score)
            assert seq.cum_logprob == pytest.approx(
                sum(lp[t].logprob for t, lp in zip(seq.output_token_ids, seq.logprobs, strict=True))
            )
            stopped = seq.output_token_ids[-1] == EOS_ID and not params.ignore_eos
            assert seq.finish_reason == ("stop" if stopped else "length")
            text_ids = seq.output_token_ids[:-1] if stopped else seq.output_token_ids
            assert seq.text == llm.get_tokenizer().decode(text_ids, skip_special_tokens=True)
            reasons.add(seq.finish_reason)
    return outputs, reasons


@pytest.mark.parametrize(
    "width,length_penalty,early_stopping",
    [
        (2, 1.0, False),
        (4, 1.0, True),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [(4, 1.0, False), (4, 0.5, False), (4, 1.0, "never"), (2, -1.0, "never")]
        ),
    ],
)
def test_beam_search_equals_transformers(hf, llm, prompts, width, length_penalty, early_stopping):
    _, reasons = assert_equal_to_transformers(
        hf, llm, prompts, width=width, length_penalty=length_penalty, early_stopping=early_stopping
    )
    if (length_penalty, early_stopping) == (1.0, False):
        assert reasons == {"stop", "length"}  # the model makes beams end both ways


def test_ignore_eos_equals_transformers_without_an_eos(hf, llm, prompts):
    outputs, reasons = assert_equal_to_transformers(hf, llm, prompts, width=4, ignore_eos=True)
    assert reasons == {"length"}
    assert any(EOS_ID in s.output_token_ids for o in outputs for s in o.sequences)


def test_the_length_penalty_and_early_stopping_change_the_answer(hf, prompts):
    """So the cases above test the rules: each setting picks other beams for some prompt (transformers'
    answers, which the cases above equal, mostly cached by them)."""

    def run(**kwargs):
        return [reference(hf, p, 4, **kwargs)[0] for p in prompts]

    default = run()
    assert run(length_penalty=0.5) != default
    assert run(early_stopping=True) != default
    assert run(early_stopping="never") != default


def test_the_prefix_cache_serves_the_beams(llm, prompts):
    """Every step request finds all its full blocks but the one it must compute the last token of cached:
    beams share their prompt's blocks (and each other's history) through the prefix cache."""
    lengths: list[list[int]] = []
    generate = llm.generate

    def spy(step_prompts, *args, **kwargs):
        lengths.append([len(p["prompt_token_ids"]) for p in step_prompts])
        return generate(step_prompts, *args, **kwargs)

    llm.reset_prefix_cache()
    before = llm.engine.stats()
    llm.generate = spy
    try:
        llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(4, MAX_TOKENS))
    finally:
        del llm.generate
    after = llm.engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert len(lengths) == MAX_TOKENS and lengths[0] == list(PROMPT_LENGTHS)
    assert queries == sum(map(sum, lengths))
    assert hits == sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for step in lengths[1:] for n in step)
    assert hits / queries > 0.6


def test_bad_params_name_the_field(llm):
    for kwargs, field in (
        ({"beam_width": 0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 0.5}, "temperature"),
        ({"length_penalty": math.inf}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ):
        with pytest.raises(ValueError, match=f"^{field} "):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match=r"^beam_width must be <= 19"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=20, max_tokens=4))
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        llm.beam_search({"prompt_token_ids": [5] * 100}, BeamSearchParams(beam_width=2, max_tokens=29))
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search({"prompt_token_ids": []}, BeamSearchParams(beam_width=2, max_tokens=4))


# -- /v1/completions with use_beam_search -------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(model_dir):
    llm = AsyncLLM(
        str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=128, engine_process=False
    )
    yield build_app(llm, ["tiny"], log_requests=False, max_n=8)
    llm.shutdown()


def test_completions_with_use_beam_search(app, llm, prompts):
    chosen = [prompts[1], prompts[4]]
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.5)
    expected = llm.beam_search([{"prompt_token_ids": p} for p in chosen], params)

    async def work(client, http):
        return await client.completions.create(
            model="tiny",
            prompt=chosen,
            n=4,
            max_tokens=MAX_TOKENS,
            logprobs=2,
            extra_body={"use_beam_search": True, "length_penalty": 0.5},
        )

    response = call_app(app, work)
    assert [c.index for c in response.choices] == list(range(8))
    beams = [s for o in expected for s in o.sequences]
    assert [c.text for c in response.choices] == [s.text for s in beams]
    assert [c.finish_reason for c in response.choices] == [s.finish_reason for s in beams]
    for choice, seq in zip(response.choices, beams, strict=True):
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(seq.cum_logprob, abs=1e-4)
        assert len(choice.logprobs.top_logprobs) == len(seq.output_token_ids)
    assert response.usage.prompt_tokens == sum(map(len, chosen))
    assert response.usage.completion_tokens == sum(len(s.output_token_ids) for s in beams)


def test_use_beam_search_errors_name_the_field(app):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True}

    async def work(client, http):
        cases = (
            ({"stream": True}, "stream"),
            ({"temperature": 0.7}, "temperature"),
            ({"n": 0}, "n"),
            ({"n": 9}, "n"),
            ({"best_of": 3}, "best_of"),
            ({"stop": ["x"]}, "stop"),
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"early_stopping": "sometimes"}, "early_stopping"),
            ({"max_tokens": 200}, "max_tokens"),
            ({"logprobs": 21}, "logprobs"),
        )
        return [(await http.post("/v1/completions", json={**body, **extra}), field) for extra, field in cases]

    for response, field in call_app(app, work):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field, response.text
