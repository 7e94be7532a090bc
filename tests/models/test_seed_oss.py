"""Seed-OSS against transformers on tiny checkpoints: logits through prefill and decode with the released
biases (q/k/v, none on o_proj) and with them switched (o_proj's and the MLP's, none on q/k/v, a tied head).
Greedy parity through the engine (chunked prefill, prefix-cache hits, preemption) is
tests/engine/test_family_parity.py (FAMILIES["seed_oss"])."""

from __future__ import annotations

import pytest
from models_harness import assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]
VARIANTS = {
    "seed_oss": {},
    "seed_oss-out-and-mlp-biases-tied": {
        "attention_bias": False,
        "attention_out_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("seed_oss", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    layer = model.model.layers[0]
    assert (layer.self_attn.qkv_proj.bias is not None) == config.attention_bias
    assert (layer.self_attn.o_proj.bias is not None) == config.attention_out_bias
    assert (layer.mlp.gate_up_proj.bias is not None) == config.mlp_bias
    assert layer.self_attn.head_dim == config.head_dim != config.hidden_size // config.num_attention_heads
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)
