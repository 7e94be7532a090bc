"""Checks every hybrid model (recurrent layers beside attention) shares: its logits against transformers'
(prompts prefilled in chunks in one batch, each chunk continuing from the states the last one left, then
decode steps that add one token to every sequence at once: the vectorised state update), speculative
decoding where the layers keep a way back from a rejected draft, and the start-up refusals of what
recurrent state rules out."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference, assert_greedy_parity, chunked_llm, mixed_prompts, small_kv_cache

from pagellm.models.base import CausalLM

ATOL = 1e-4
PROMPTS = {0: [(7 * i + 5) % 380 + 3 for i in range(45)], 1: [(11 * i + 2) % 380 + 3 for i in range(30)]}
CHUNK = 16
MAX_MODEL_LEN, TOKEN_BUDGET = 400, 48


def assert_chunked_prefill_and_decode_match(
    model: CausalLM,
    reference: torch.nn.Module,
    prompts: dict[int, list[int]],
    chunk: int,
    decode_steps: int = 4,
    atol: float = ATOL,
) -> None:
    """`prompts`: sequence number -> its prompt, prefilled together `chunk` tokens a step, then
    `decode_steps` greedy tokens each; every chunk's logits and every decode step's must equal
    transformers' at the same positions within `atol`."""
    runner = PagedRunner(model, num_seqs=len(prompts))
    ids = {s: list(p) for s, p in prompts.items()}
    done = dict.fromkeys(ids, 0)
    while any(done[s] < len(ids[s]) for s in ids):
        chunks = {s: ids[s][done[s] : done[s] + chunk] for s in ids if done[s] < len(ids[s])}
        got = runner.step(chunks)
        for s, part in chunks.items():
            done[s] += len(part)
            want = reference_logits(reference, ids[s][: done[s]])[-len(part) :]
            torch.testing.assert_close(got[s], want, atol=atol, rtol=0)
    last = {s: reference_logits(reference, ids[s])[-1] for s in ids}
    for _ in range(decode_steps):
        for s in ids:
            ids[s].append(int(last[s].argmax()))
        got = runner.step({s: ids[s][-1:] for s in ids})
        for s in ids:
            last[s] = reference_logits(reference, ids[s])[-1]
            torch.testing.assert_close(got[s][-1], last[s], atol=atol, rtol=0)


def assert_checkpoint_logits_match(path: Path) -> CausalLM:
    """The float32 checkpoint at `path` against transformers': PROMPTS in chunks of CHUNK tokens, then
    decode steps. Returns the pagellm model, for the caller's own checks."""
    model = load_pagellm(path)
    assert_chunked_prefill_and_decode_match(model, load_reference(path), PROMPTS, CHUNK)
    return model


def assert_engine_parity_under_preemption(
    path: Path, reference: Reference, state_layers: int, lengths: tuple[int, ...], caplog
) -> None:
    """Through the engine with a small token budget and KV cache: prompts of `lengths` tokens (the long ones
    in several chunks, enough at once to preempt) give transformers' greedy tokens; the recurrent layers are
    logged and prefix caching is off, as recurrent state rules it out."""
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = chunked_llm(path, MAX_MODEL_LEN, TOKEN_BUDGET)
    assert f"recurrent state: {state_layers} layers" in caplog.text and "prefix caching off" in caplog.text
    prompts = [p for p in mixed_prompts(300, seed=1) if len(p) in lengths]
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits == 0


def assert_every_mixed_prompt_matches(path: Path, reference: Reference) -> None:
    """Every mixed prompt through the engine of assert_engine_parity_under_preemption."""
    llm = chunked_llm(path, MAX_MODEL_LEN, TOKEN_BUDGET)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=2))


def assert_speculation_keeps_greedy_output(path: Path, reference: Reference | None = None) -> None:
    """Speculative decoding on a model with delta-rule layers (`RecurrentLayer.replays_drafts`): greedy
    outputs equal transformers' (`reference`, by default 16 tokens) through chunked prefill, a batch and
    preemption. The drafts are transformers' own next tokens with one in three replaced (a random tiny
    model repeats nothing an n-gram lookup would find), so steps accept some drafts and reject the rest;
    after a rejection the layers' states are put back to those of the accepted rows (`DraftReplay`), else
    every later token would read the rejected drafts."""
    from pagellm import LLM

    reference = reference or Reference(path, 16)
    prompts = mixed_prompts(300, seed=6)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=small_kv_cache(path, MAX_MODEL_LEN, TOKEN_BUDGET, spare=2),
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    continuations = {tuple(p): reference.generate(p) for p in prompts}
    calls = []

    def propose(requests):
        drafts = []
        for r in requests:
            prompt = next(p for p in continuations if tuple(r.token_ids[: len(p)]) == p)
            done = len(r.token_ids) - len(prompt)
            draft = list(continuations[prompt][done : done + r.num_drafts])
            calls.append(len(calls))
            if draft and len(calls) % 3:  # two calls in three: one draft wrong
                wrong = len(calls) % len(draft)
                draft[wrong] = (draft[wrong] + 1) % 300 + 3
            drafts.append(draft)
        return drafts

    llm.engine.runner.spec_decode.proposer.propose = propose
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats
    assert stats.num_preemptions > 0, stats


def assert_sampled_speculation_keeps_the_distribution(path: Path, reference: Reference) -> None:
    """Seeded requests of 3 tokens at temperature 0.3, each drafting once a token the target all but
    never samples after the likeliest first token t1: the verify step rejects it and draws the second
    token in its place, so the third comes from the next step, after each delta-rule layer's state was
    put back to the one after t1 (the step's second row read the rejected draft). Given the
    likeliest first two tokens (t1, t2), the third must follow transformers' p(. | prompt, t1, t2)
    (chi-square below its 0.1% critical value), a test that a point mass fails."""
    import numpy as np

    from pagellm import LLM, SamplingParams

    prompt, temperature = list(range(5, 13)), 0.3

    def probabilities(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return (reference.model(torch.tensor([ids])).logits[0, -1] / temperature).softmax(-1).numpy()

    t1 = int(probabilities(prompt).argmax())
    p2 = probabilities(prompt + [t1])
    t2, unlikely = int(p2.argmax()), int(p2.argmin())
    p3 = probabilities(prompt + [t1, t2])
    llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=1200, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    llm.engine.runner.spec_decode.proposer.propose = lambda requests: [
        [unlikely] * r.num_drafts for r in requests
    ]
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=i) for i in range(4000)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    thirds = [o.outputs[0].token_ids[2] for o in outs if o.outputs[0].token_ids[:2] == [t1, t2]]
    stats = llm.engine.stats()
    assert len(thirds) > 300 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens, (
        len(thirds),
        stats,
    )
    observed = np.bincount(thirds, minlength=len(p3)).astype(float)
    assert not chi_square_p_below_0_1_percent(observed, p3)
    point_mass = np.eye(len(p3))[int(p3.argmax())] * 0.999 + 0.001 / len(p3)
    assert chi_square_p_below_0_1_percent(observed, point_mass)


def chi_square_p_below_0_1_percent(observed, probabilities) -> bool:
    """Pearson's test over the tokens expected at least 5 times, the rest pooled; the 0.1% critical value
    by the Wilson-Hilferty approximation (z = 3.09)."""
    import numpy as np

    expected = probabilities * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    return statistic > critical


def assert_parallelism_refused(path: Path, unsplit: str) -> None:
    """Tensor parallelism (the recurrent layers have no split; `unsplit` is part of the reason given) is
    refused at start-up."""
    from pagellm.core.config import EngineConfig
    from pagellm.core.errors import ConfigError
    from pagellm.engine.setup import resolve_engine

    with pytest.raises(ConfigError, match=unsplit):
        resolve_engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))


def assert_speculation_refused(path: Path, layers: str) -> None:
    """Speculative decoding on recurrent layers that keep no way back from a rejected draft (`layers`,
    their class) is refused at start-up."""
    from pagellm import LLM
    from pagellm.core.errors import ConfigError

    speculative = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=f"recurrent layers: {layers}"):
        LLM(str(path), dtype="float32", num_kv_blocks=64, speculative_config=speculative)


def assert_compiled_forward_matches(
    path: Path, reference: Reference | None = None, seed: int = 3, count: int = 4
) -> None:
    """torch.compile sees the projections and norms, the recurrent layers' ops stay opaque: greedy outputs
    of `count` mixed prompts (drawn with `seed`) equal transformers' (`reference`, by default 16 tokens)."""
    from pagellm import LLM

    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, enforce_eager=False)
    assert llm.engine.runner.forward is not llm.engine.runner.model
    assert_greedy_parity(llm, reference or Reference(path, 16), mixed_prompts(300, seed=seed)[:count])
