"""Falcon-H1 (attention and Mamba-2 side by side in every layer, with its multipliers and muP vector) against
transformers in float32: logits of two sequences prefilled in chunks that cut the states mid scan chunk, then
decoded together (the vectorised state update), for each of the Mamba norm's forms; greedy parity through the
engine under chunked prefill and preemption (prefix caching is off for recurrent models); under -m slow,
every mixed prompt that way, the compiled forward, and LoRA on attention and MLP (one on the Mamba
projections refused)."""

from __future__ import annotations

import pytest
from hybrid_checks import (
    assert_chunked_prefill_and_decode_match,
    assert_compiled_forward_matches,
    assert_engine_parity_under_preemption,
    assert_every_mixed_prompt_matches,
)
from models_harness import load_pagellm, load_reference
from parity import Reference, assert_greedy_parity, mixed_prompts
from peft_adapters import EVERY_PROJECTION, assert_adapter_refused, lora_engine, make_peft_adapter
from tiny import make_tiny_checkpoint

PROMPTS = {0: [(7 * i + 5) % 380 + 3 for i in range(45)], 1: [(11 * i + 2) % 380 + 3 for i in range(21)]}
CHUNK = 19  # prefill steps of 19 tokens: the scan's 16-token chunks cut at varying offsets
VARIANTS = {
    "falcon_h1": {},  # the released configs' form: gated RMSNorm, the gate before the norm
    "falcon_h1-norm-before-gate": {"mamba_norm_before_gate": True},
    # no Mamba norm (y * silu(z)), no projector bias, tied embeddings
    "falcon_h1-no-norm-tied": {
        "mamba_rms_norm": False,
        "projectors_bias": False,
        "tie_word_embeddings": True,
    },
}
MAX_TOKENS = 16
LENGTHS = (1, 17, 33, 100, 200, 330)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_batched_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("falcon_h1", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    assert len(model.attention_layers()) == len(model.state_layers()) == 2
    assert (model.lm_head is model.model.embed_tokens) == reference.config.tie_word_embeddings
    assert_chunked_prefill_and_decode_match(model, reference, PROMPTS, CHUNK)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint("falcon_h1", tmp_path_factory.mktemp("falcon_h1"))
    return path, Reference(path, MAX_TOKENS)


def test_matches_transformers_under_chunking_and_preemption(model, caplog):
    assert_engine_parity_under_preemption(*model, 2, LENGTHS, caplog)


@pytest.mark.slow
def test_every_mixed_prompt_under_chunking_and_preemption(model):
    assert_every_mixed_prompt_matches(*model)


@pytest.mark.slow
def test_compiled_forward_matches_transformers(model):
    """torch.compile sees the projections, multipliers and norms; the conv and scan stay one opaque op."""
    assert_compiled_forward_matches(*model, seed=4, count=6)


@pytest.mark.slow
def test_lora_on_attention_and_mlp_equals_peft_merged_and_on_mamba_is_refused(model, tmp_path):
    """A PEFT adapter on q/k/v/o and gate/up/down (inside the multipliers, as in transformers): greedy outputs
    equal peft's merged model's. One on the Mamba in_proj is refused when it is added, naming the module."""
    path, _ = model
    with_adapter = lora_engine(path, tmp_path / "a", EVERY_PROJECTION)
    prompts = mixed_prompts(300)[:6]
    assert_greedy_parity(with_adapter, Reference(tmp_path / "a" / "merged", 8), prompts)
    mamba = make_peft_adapter(path, tmp_path / "m", ["in_proj"], merged=False)
    assert_adapter_refused(with_adapter.llm, mamba, prompts, "in_proj")
