"""Each architecture but Llama (tests/models/parity.py ARCHS and FAMILIES) in one engine that exercises what splits the
work: chunked prefill, prefix-cache hits and preemption together, greedy-identical to transformers. The
full settings matrix per family runs under -m slow (test_llm_parity.py)."""

from __future__ import annotations

import pytest
from parity import (
    ARCHS,
    FAMILIES,
    SLOW_FAMILIES,
    assert_greedy_parity,
    mixed_prompts,
    small_kv_cache,
    tiny_model_and_reference,
)

from pagellm import LLM

MAX_TOKENS = 16
MAX_MODEL_LEN, TOKEN_BUDGET = 400, 48


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAMILIES else f
        for f in [*ARCHS, *FAMILIES]
        if f != "llama"  # test_llm_parity.py runs its whole matrix
    ],
)
def test_family_matches_transformers_under_chunking_prefix_hits_and_preemption(family, tmp_path):
    path, reference = tiny_model_and_reference(family, tmp_path, MAX_TOKENS)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=small_kv_cache(path, MAX_MODEL_LEN, TOKEN_BUDGET),
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=8,
    )
    prompts = mixed_prompts(300, seed=1, shared_prefix=40)
    assert_greedy_parity(llm, reference, prompts[:1])  # the first request fills the cache
    assert_greedy_parity(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    if llm.engine.runner.state_layers:  # prefix caching is off for models with recurrent layers
        assert stats.prefix_cache_hits == 0
    else:
        assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0
