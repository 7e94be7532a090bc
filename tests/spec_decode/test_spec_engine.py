"""Speculative decoding end to end: greedy tokens equal transformers' with drafts on, whatever the
proposer guesses (n-gram, an oracle that is always right, an adversary that is always wrong), under
chunked prefill, preemption and prefix-cache hits, on every architecture and CPU backend; sampled
tokens stay reproducible per seed; penalties and logprobs see the accepted tokens."""

from __future__ import annotations

import random

import pytest
from parity import ARCHS, Reference, assert_greedy_parity, mixed_prompts, tiny_model_and_reference
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.spec_decode.proposer import Proposer

MAX_TOKENS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(
    scope="module",
    params=["llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS if a != "llama")],
)
def model(request, tmp_path_factory):
    return tiny_model_and_reference(request.param, tmp_path_factory.mktemp(request.param), MAX_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return path, Reference(path, MAX_TOKENS)


def engine(path, speculative=NGRAM, **overrides) -> LLM:
    settings = dict(dtype="float32", num_kv_blocks=400, max_model_len=400, speculative_config=speculative)
    settings.update(overrides)
    return LLM(str(path), **settings)


def copy_friendly_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose continuations n-gram lookup can guess: a phrase repeated, one word repeated."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab) for _ in range(12)]
    return [phrase * 5, [rng.randrange(3, vocab)] * 60, phrase[:5] * 9 + phrase]


class OracleProposer(Proposer):
    """Proposes the known continuation of each prompt (transformers' greedy output, or a run without
    speculation): every draft right, up to a near-tie."""

    name = "oracle"

    def __init__(self, reference: Reference | None, prompts: list[list[int]], expected=None):
        self.expected = {
            tuple(p): (expected[i] if expected else reference.generate(p)) for i, p in enumerate(prompts)
        }

    def propose(self, requests):
        drafts = []
        for r in requests:
            tokens = list(r.token_ids)
            for prompt, expected in self.expected.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    drafts.append(expected[done : done + r.num_drafts])
                    break
            else:
                drafts.append([])
        return drafts


class AdversarialProposer(OracleProposer):
    """Proposes a token the target never chooses at the first position, then random ones."""

    name = "adversary"

    def propose(self, requests):
        wrong = []
        for r, right in zip(requests, super().propose(requests), strict=True):
            wrong.append([(t + 1) % 300 for t in right] + [5] * (r.num_drafts - len(right)))
        return wrong


def with_proposer(llm: LLM, proposer: Proposer) -> LLM:
    llm.engine.runner.spec_decode.proposer = proposer
    return llm


def test_ngram_greedy_parity_on_copy_friendly_and_random_prompts(model):
    path, reference = model
    llm = engine(path)
    prompts = copy_friendly_prompts(300) + mixed_prompts(300)
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0


def test_oracle_and_adversary_keep_greedy_tokens_under_chunking_and_preemption(model):
    path, reference = model
    prompts = copy_friendly_prompts(300, seed=1) + mixed_prompts(300, seed=2)
    # a sliding-window model frees the blocks behind its window: it preempts only with fewer blocks
    blocks = 12 if path.name == "tiny-mistral" else 24
    tight = dict(max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=blocks, max_model_len=360)
    oracle = with_proposer(engine(path, **tight), OracleProposer(reference, prompts))
    assert_greedy_parity(oracle, reference, prompts)
    stats = oracle.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
    adversary = with_proposer(engine(path, **tight), AdversarialProposer(reference, prompts))
    assert_greedy_parity(adversary, reference, prompts)
    stats = adversary.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == 0


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"])
def test_every_cpu_backend_verifies_drafts_exactly(llama, backend):
    path, reference = llama
    prompts = copy_friendly_prompts(300, seed=3) + mixed_prompts(300, seed=3)[:8]
    llm = with_proposer(engine(path, attention_backend=backend), OracleProposer(reference, prompts))
    assert_greedy_parity(llm, reference, prompts)


def test_prefix_cache_hits_with_drafts_and_the_same_request_twice(llama):
    """vllm-project/vllm#40896: a greedy request must give the same tokens again once its prefix is cached."""
    path, reference = llama
    llm = engine(path)
    prompts = mixed_prompts(300, seed=4, shared_prefix=40) + copy_friendly_prompts(300, seed=4)
    assert_greedy_parity(llm, reference, prompts)
    hits = llm.engine.stats().prefix_cache_hits
    assert_greedy_parity(llm, reference, prompts)  # again, now from the cache
    assert llm.engine.stats().prefix_cache_hits - hits >= 32 * len(prompts)


def test_one_word_repeated_gives_the_same_tokens_with_ngram_on_and_off(llama):
    """vllm-project/vllm#41758: n-gram speculation changed greedy output on a prompt repeating one word."""
    path, _ = llama
    prompts = [{"prompt_token_ids": [17] * n} for n in (3, 50, 200)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    on = engine(path, speculative={"method": "ngram", "num_speculative_tokens": 5}).generate(
        prompts, params, use_tqdm=False
    )
    off = engine(path, speculative=None).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_penalties_min_tokens_and_logprobs_see_the_accepted_drafts(llama):
    """Row j of a verified request is penalised as if drafts 0..j-1 were output; its logprobs are the
    ones of the position each token came from."""
    path, reference = llama
    prompts = copy_friendly_prompts(300, seed=5)
    params = SamplingParams(
        temperature=0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=20,
        logit_bias={11: 2.0}, logprobs=3,
    )  # fmt: skip
    plain = engine(path, speculative=None).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    expected = [o.outputs[0].token_ids for o in plain]
    spec = with_proposer(engine(path), OracleProposer(None, prompts, expected))
    ours = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = spec.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 40
    for a, b in zip(plain, ours, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            for t in lp_a:
                assert lp_a[t].logprob == pytest.approx(lp_b[t].logprob, abs=1e-4)


def test_seeded_sampling_with_drafts_is_the_same_alone_and_in_a_batch(llama):
    path, _ = llama
    prompts = copy_friendly_prompts(300, seed=6)
    llm = engine(path, speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=42, max_tokens=30, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate([batch[1], batch[0], batch[2]], [others, seeded, others], use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_abort_while_speculating_frees_the_blocks(llama):
    path, _ = llama
    llm = engine(path)
    llm.engine.add_request(
        {"prompt_token_ids": [9] * 30}, SamplingParams(max_tokens=100, ignore_eos=True), "x"
    )
    for _ in range(4):
        llm.engine.step()
    assert llm.engine.scheduler.kv_cache_manager.usage > 0
    llm.engine.abort_request("x")
    llm.engine.step()
    assert (
        llm.engine.scheduler.kv_cache_manager.num_free_blocks
        == llm.engine.scheduler.kv_cache_manager.num_blocks - 1
    )


def test_a_stop_string_inside_accepted_drafts_ends_the_output_where_it_would_without_them(llama):
    path, _ = llama
    prompts = copy_friendly_prompts(300, seed=7)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    plain_llm = engine(path, speculative=None)
    texts = [
        o.outputs[0].text
        for o in plain_llm.generate([{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)
    ]
    expected = [
        o.outputs[0].token_ids
        for o in plain_llm.generate([{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)
    ]
    stops = [t[len(t) // 2 : len(t) // 2 + 3] for t in texts]  # a piece of each text from its middle
    for prompt, stop, tokens in zip(prompts, stops, expected, strict=True):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=1)
        plain = plain_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        spec = with_proposer(engine(path), OracleProposer(None, [prompt], [tokens]))
        ours = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert spec.engine.stats().spec_num_accepted_tokens > 0
        assert (ours.text, ours.token_ids, ours.finish_reason, ours.stop_reason) == (
            plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason,
        )  # fmt: skip
        assert len(ours.logprobs) == len(ours.token_ids) < 30
