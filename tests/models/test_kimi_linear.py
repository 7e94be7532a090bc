"""Kimi Linear (KDA layers with a per-channel decay and a recurrent state per sequence, MLA without rotary,
DeepSeek-V3's experts) against transformers on tiny checkpoints in float32: logits through a prefill cut in
chunks (the states carried from chunk to chunk) and decode steps of two sequences at once, with plain and
low-rank queries; the refusals. Greedy parity through the engine (chunked prefill, preemption; prefix caching
off) is tests/engine/test_family_parity.py (FAMILIES["kimi_linear"])."""

from __future__ import annotations

import pytest
import torch
from hybrid_checks import (
    assert_checkpoint_logits_match,
    assert_compiled_forward_matches,
    assert_parallelism_refused,
    assert_speculation_keeps_greedy_output,
)
from models_harness import load_pagellm
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError
from pagellm.models.layers.kda_ops import kda_decode, kda_prefill

VARIANTS = {
    "plain-q": {},  # as released: q_proj, no q LoRA
    "low-rank-q": {"q_lora_rank": 24},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("kimi_linear", tmp_path, **VARIANTS[variant])
    model = assert_checkpoint_logits_match(path)
    assert len(model.attention_layers()) == 1 and len(model.state_layers()) == 3
    assert model.attention_layers()[0].spec.latent_kv


def test_kda_ops_match_transformers_recurrence():
    """The prefill loop and the batched decode step against transformers' own recurrent reference, from a
    nonzero state, with decays per key channel that differ across channels."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    gen = torch.Generator().manual_seed(0)
    length, heads, dim = 9, 3, 8
    q, k, v = (torch.randn(length, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(length, heads, dim, generator=gen) * 2
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dim, dim, generator=gen)
    want, want_state = recurrent_kimi_delta_attention(
        q[None], k[None], v[None], g[None], beta[None], state[None], True, use_qk_l2norm_in_kernel=True
    )
    got, got_state = kda_prefill(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-5, rtol=0)
    batch = state[None].repeat(length, 1, 1, 1)  # every token as its own sequence, from the same state
    one_step = kda_decode(q, k, v, g, beta, batch)
    for t in range(length):
        want_t, _ = recurrent_kimi_delta_attention(
            q[None, t : t + 1],
            k[None, t : t + 1],
            v[None, t : t + 1],
            g[None, t : t + 1],
            beta[None, t : t + 1],
            state[None],
            False,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(one_step[t], want_t[0, 0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
            "sliding_attention",
        ),
    ],
)
def test_unsupported_configs_are_refused(overrides, match, tmp_path):
    path = make_tiny_checkpoint("kimi_linear", tmp_path, **overrides)
    with pytest.raises(ConfigError, match=match):
        load_pagellm(path)


def test_speculative_decoding_keeps_the_greedy_output(tmp_path):
    assert_speculation_keeps_greedy_output(make_tiny_checkpoint("kimi_linear", tmp_path))


def test_parallelism_is_refused_at_start_up(tmp_path):
    assert_parallelism_refused(make_tiny_checkpoint("kimi_linear", tmp_path), "KDA layers")


@pytest.mark.slow
def test_compiled_forward_matches_transformers(tmp_path):
    assert_compiled_forward_matches(make_tiny_checkpoint("kimi_linear", tmp_path))
