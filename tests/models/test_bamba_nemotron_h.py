"""Bamba and Nemotron-H (Mamba-2 hybrids on Granite 4.0-H's Mamba layer) against transformers in float32: a batch
mixing short and long prompts under chunked prefill that cuts the states mid-sequence (and mid scan chunk) and
preemption that drops them; under -m slow, every mixed prompt that way, the default engine (whole prompts, then
decode steps that update every state at once), and Nemotron-H's refusal of mixture-of-experts blocks."""

from __future__ import annotations

import logging

import pytest
from hybrid_checks import assert_speculation_refused
from parity import Reference, assert_greedy_parity, chunked_llm, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.errors import ConfigError

# the default run: three prompts of 1 to 128 tokens in 40-token steps (crossing the scan's 16-token chunks at
# varying offsets) over a KV cache of one 160-token request and 2 blocks, so that they preempt; 4 tokens each
MAX_MODEL_LEN, TOKEN_BUDGET = 160, 40
LENGTHS = (1, 33, 128)
MAX_TOKENS, SLOW_MAX_TOKENS = 4, 16
MAMBA_LAYERS = {"bamba": 2, "nemotron_h": 2}


@pytest.fixture(scope="module", params=sorted(MAMBA_LAYERS))
def model(request, tmp_path_factory):
    return request.param, make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_matches_transformers_under_chunking_and_preemption(model, caplog):
    arch, path = model
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = chunked_llm(path, MAX_MODEL_LEN, TOKEN_BUDGET, spare=2)
    assert f"recurrent state: {MAMBA_LAYERS[arch]} layers" in caplog.text
    prompts = [p for p in mixed_prompts(300, seed=1) if len(p) in LENGTHS]
    assert_greedy_parity(llm, Reference(path, MAX_TOKENS), prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits == 0


@pytest.mark.slow
def test_every_mixed_prompt_under_chunking_and_preemption(model):
    _, path = model
    reference = Reference(path, SLOW_MAX_TOKENS)
    assert_greedy_parity(chunked_llm(path, 400, TOKEN_BUDGET), reference, mixed_prompts(300, seed=2))


@pytest.mark.slow
def test_default_engine_matches_transformers(model):
    _, path = model
    llm = LLM(str(path), dtype="float32", max_model_len=400, num_kv_blocks=256, max_num_seqs=4)
    assert_greedy_parity(llm, Reference(path, SLOW_MAX_TOKENS), mixed_prompts(300, seed=3)[:6])


@pytest.mark.slow
def test_nemotron_h_refuses_expert_blocks(tmp_path):
    path = make_tiny_checkpoint(
        "nemotron_h",
        tmp_path,
        hybrid_override_pattern="M*E",
        n_routed_experts=4,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    )
    with pytest.raises(ConfigError, match="moe are not supported"):
        LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_speculative_decoding_is_refused_at_start_up(model):
    """Mamba-2 layers keep no way back from a rejected draft (the delta-rule layers do: hybrid_checks)."""
    assert_speculation_refused(model[1], "Mamba2Mixer")
