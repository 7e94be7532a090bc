"""OLMo Hybrid (Gated DeltaNet layers with beta in (0, 2) beside OLMo attention) against transformers on tiny
checkpoints in float32: logits through a prefill cut in chunks (the states carried from chunk to chunk) and
decode steps of two sequences at once (the vectorised state update), NoPE as released and with rotary; the
refusals. Greedy parity through the engine (chunked prefill, preemption; prefix caching off) is
tests/engine/test_family_parity.py (FAMILIES["olmo_hybrid"])."""

from __future__ import annotations

import pytest
from hybrid_checks import (
    assert_checkpoint_logits_match,
    assert_compiled_forward_matches,
    assert_parallelism_refused,
    assert_speculation_keeps_greedy_output,
)
from models_harness import load_pagellm
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError

VARIANTS = {
    "nope": {},  # the released models' attention: no rotary
    "rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "no-negative-eigenvalues": {"linear_allow_neg_eigval": False},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("olmo_hybrid", tmp_path, **VARIANTS[variant])
    model = assert_checkpoint_logits_match(path)
    assert len(model.attention_layers()) == 1 and len(model.state_layers()) == 3
    assert (model.model.rotary_emb is None) == (variant != "rope")


def test_beta_is_doubled_with_negative_eigenvalues(tmp_path):
    """The switch is read from the config: beta's scale, and nothing else, tells the two variants apart."""
    scales = {}
    for allow in (True, False):
        path = make_tiny_checkpoint("olmo_hybrid", tmp_path / str(allow), linear_allow_neg_eigval=allow)
        scales[allow] = {layer.beta_scale for layer in load_pagellm(path).state_layers()}
    assert scales == {True: {2.0}, False: {1.0}}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            "sliding_attention",
        ),
    ],
)
def test_unsupported_configs_are_refused(overrides, match, tmp_path):
    path = make_tiny_checkpoint("olmo_hybrid", tmp_path, **overrides)
    with pytest.raises(ConfigError, match=match):
        load_pagellm(path)


def test_speculative_decoding_keeps_the_greedy_output(tmp_path):
    assert_speculation_keeps_greedy_output(make_tiny_checkpoint("olmo_hybrid", tmp_path))


def test_parallelism_is_refused_at_start_up(tmp_path):
    assert_parallelism_refused(make_tiny_checkpoint("olmo_hybrid", tmp_path), "Gated DeltaNet layers")


@pytest.mark.slow
def test_compiled_forward_matches_transformers(tmp_path):
    assert_compiled_forward_matches(make_tiny_checkpoint("olmo_hybrid", tmp_path))
