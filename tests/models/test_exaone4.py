"""EXAONE 4 against transformers on tiny checkpoints: logits through prefill and decode in the 32B's hybrid
form (windows with rotary on three layers of four, the fourth full without rotary), the 1.2B's (no window,
every layer full and rotating, a tied head) and with llama3 rope scaling; sliding layers without a window
refused. Greedy parity through the engine (chunked prefill, prefix-cache hits, preemption) is
tests/engine/test_family_parity.py (FAMILIES["exaone4"])."""

from __future__ import annotations

import pytest
from models_harness import assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]  # longer than the window of 32
VARIANTS = {
    "exaone4": {},
    "exaone4-no-window-tied": {
        "sliding_window": None,
        "layer_types": ["full_attention"] * 4,
        "tie_word_embeddings": True,
    },
    "exaone4-llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 1_000_000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("exaone4", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    sliding = [t == "sliding_attention" for t in config.layer_types]
    windows = [config.sliding_window if s else None for s in sliding]
    assert [a.spec.sliding_window for a in model.attention_layers()] == windows
    rope = [s or config.sliding_window is None for s in sliding]
    assert [layer.use_rope for layer in model.model.layers] == rope
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_sliding_layers_without_a_window_are_refused(tmp_path):
    path = make_tiny_checkpoint(
        "exaone4", tmp_path, sliding_window=None, layer_types=["sliding_attention"] * 4
    )
    with pytest.raises(ConfigError, match="no sliding_window"):
        load_pagellm(path)
