"""OLMo 3 against transformers on tiny checkpoints: logits through prefill and decode, with a rope per layer
type (YaRN on the full layers) and with the released 7B's one plain rope, the windows on the layers
`layer_types` marks sliding; bf16 rotating in float32; a length-dependent rope refused. Greedy parity
through the engine (chunked prefill, prefix-cache hits, preemption) is tests/engine/test_family_parity.py
(FAMILIES["olmo3"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_bf16_close, assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]  # longer than the window of 32
VARIANTS = {
    "olmo3": {},
    # the 7B's rope: the config's default, one plain rope (base 500000) for both layer types
    "olmo3-one-rope": {"rope_parameters": None},
    # two layers: the default pattern makes both sliding, so only the sliding layers' rope is built
    "olmo3-all-sliding": {"num_hidden_layers": 2, "layer_types": None},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("olmo3", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    windows = [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]
    assert [a.spec.sliding_window for a in model.attention_layers()] == windows
    assert len(model.model.rotaries) == len(set(config.layer_types))
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_bfloat16_rotates_in_float32_as_transformers_does(tmp_path):
    """transformers keeps OLMo's cos/sin in float32, so bf16 q and k rotate in float32 and are cast back;
    rotating in bf16 instead moves these logits by ~0.09 (equal on CPU when done as transformers does)."""
    path = make_tiny_checkpoint("olmo3", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    assert_bf16_close(model, reference, PROMPT, atol=0.03)


def test_a_length_dependent_rope_is_refused(tmp_path):
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    }
    path = make_tiny_checkpoint("olmo3", tmp_path, rope_parameters=rope)
    with pytest.raises(ConfigError, match="'dynamic' on its full_attention layers"):
        load_pagellm(path)
