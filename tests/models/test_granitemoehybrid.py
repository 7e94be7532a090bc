"""Granite 4.0-H (Mamba-2 layers with a recurrent state per sequence beside attention, Granite's multipliers, the
shared MLP with or without routed experts) against transformers in float32: a batch mixing short and long prompts
under chunked prefill that cuts the states mid-sequence (and mid scan chunk) and preemption that drops them."""

from __future__ import annotations

import logging

import pytest
from parity import Reference, assert_greedy_parity, chunked_llm, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM

MAX_TOKENS = 16
MAX_MODEL_LEN, TOKEN_BUDGET = 400, 48
# the default run's prompts: 1 to 330 tokens, the long ones in several 48-token chunks (each crossing the
# scan's 16-token chunks at another offset), enough of them at once to preempt
LENGTHS = (1, 17, 33, 80, 100, 200, 330)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granitemoehybrid"))
    return path, Reference(path, MAX_TOKENS)


def test_matches_transformers_under_chunking_and_preemption(model, caplog):
    path, reference = model
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = chunked_llm(path, MAX_MODEL_LEN, TOKEN_BUDGET)
    assert "recurrent state: 3 layers" in caplog.text and "prefix caching off" in caplog.text
    prompts = [p for p in mixed_prompts(300, seed=1) if len(p) in LENGTHS]
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits == 0


@pytest.mark.slow
def test_every_mixed_prompt_under_chunking_and_preemption(model):
    path, reference = model
    assert_greedy_parity(
        chunked_llm(path, MAX_MODEL_LEN, TOKEN_BUDGET), reference, mixed_prompts(300, seed=2)
    )


def test_dense_with_rotary_matches_transformers(tmp_path):
    """Granite 4.0-H micro's kind: the shared MLP alone, and rope in the attention layer; whole prompts in
    one step, then decode steps that update every state at once."""
    path = make_tiny_checkpoint("granitemoehybrid_dense", tmp_path)
    reference = Reference(path, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=4)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=3)[:6])


@pytest.mark.slow
def test_compiled_forward_matches_transformers(model):
    """torch.compile sees the projections and norms; the conv and scan stay one opaque op."""
    path, reference = model
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, enforce_eager=False)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=4)[:6])
