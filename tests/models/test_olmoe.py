"""OLMoE against transformers on tiny checkpoints: logits through prefill and decode, as released
(top 2 not renormalised) and with `norm_topk_prob` and `clip_qkv` (which the released models leave off),
and in bf16. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_bf16_close, assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint

from pagellm.models.layers.fused_moe.block import SparseMoeBlock

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
VARIANTS = {
    "released": {},
    # clip at 1.5: q and k after their norms and v all reach past it with these weights
    "renormalised-clipped": {"norm_topk_prob": True, "clip_qkv": 1.5},
}


@torch.no_grad()
def _clips(reference) -> bool:
    """Whether the first layer has q, k and v values past clip_qkv (so that the test sees the clamp)."""
    attn = reference.model.layers[0].self_attn
    h = reference.model.layers[0].input_layernorm(reference.model.embed_tokens(torch.tensor(PROMPT)))
    values = [attn.q_norm(attn.q_proj(h)), attn.k_norm(attn.k_proj(h)), attn.v_proj(h)]
    return all(bool((t.abs() > reference.config.clip_qkv).any()) for t in values)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    if reference.config.clip_qkv is not None:
        assert _clips(reference)
    model = load_pagellm(path)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_bfloat16_model_stays_close_to_transformers_bfloat16(tmp_path):
    path = make_tiny_checkpoint("olmoe", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    assert_bf16_close(model, reference, PROMPT, atol=0.15)
