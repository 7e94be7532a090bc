"""Speculative decoding with a draft model: greedy tokens equal transformers' whatever the draft, the
draft's KV stays in step with the target's (a draft that is the target itself is accepted every time,
through chunked prefill, prefix-cache hits and preemption), and a draft with another vocabulary is refused
at start-up."""

from __future__ import annotations

import pytest
from parity import ARCHS, assert_greedy_parity, mixed_prompts, tiny_model_and_reference
from test_spec_engine import copy_friendly_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.errors import ConfigError

MAX_TOKENS = 16


@pytest.fixture(
    scope="module",
    params=["llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS if a != "llama")],
)
def target(request, tmp_path_factory):
    return tiny_model_and_reference(request.param, tmp_path_factory.mktemp(request.param), MAX_TOKENS)


def engine(path, draft, k=3, **overrides) -> LLM:
    settings = dict(
        dtype="float32", num_kv_blocks=400, max_model_len=400,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
    )  # fmt: skip
    settings.update(overrides)
    return LLM(str(path), **settings)


def test_the_target_as_its_own_draft_is_always_accepted_through_chunking_caching_and_preemption(target):
    """Any draft KV out of step with the target's (a block from the prefix cache, a chunk, a recompute
    after preemption, a slot of a rejected draft) would make the draft disagree and show here."""
    path, reference = target
    prompts = mixed_prompts(300, seed=1, shared_prefix=16) + copy_friendly_prompts(300, seed=1)
    llm = engine(
        path, path, k=4, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=24, max_model_len=368
    )
    assert_greedy_parity(llm, reference, prompts)
    assert_greedy_parity(llm, reference, prompts[:6])  # again, from the prefix cache
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0


def test_a_different_draft_model_keeps_the_greedy_tokens(target, tmp_path):
    path, reference = target
    draft = make_tiny_checkpoint("llama", tmp_path, seed=7, num_hidden_layers=1)
    llm = engine(path, draft, k=3)
    prompts = copy_friendly_prompts(300, seed=2) + mixed_prompts(300, seed=2)
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # a random draft is often wrong


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model_and_reference("llama", tmp_path_factory.mktemp("llama"), MAX_TOKENS)


# CPU_ATTN: the tests above; FLEX_ATTENTION (never selected on CPU) under -m slow
@pytest.mark.parametrize("backend", ["TORCH_SDPA", pytest.param("FLEX_ATTENTION", marks=pytest.mark.slow)])
def test_the_draft_runs_on_every_cpu_backend(llama, tmp_path, backend):
    path, reference = llama
    llm = engine(path, path, k=3, attention_backend=backend)
    assert_greedy_parity(llm, reference, copy_friendly_prompts(300, seed=3) + mixed_prompts(300, seed=3)[:6])
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(llama, tmp_path):
    path, _ = llama
    draft = make_tiny_checkpoint("llama", tmp_path, vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary"):
        engine(path, draft)
