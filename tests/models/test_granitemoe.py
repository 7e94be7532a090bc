"""Granite MoE against transformers on tiny checkpoints: logits through prefill and decode with tied and
untied embeddings, and the stacked expert tensors split per expert as the checkpoint lays them out. Greedy
parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from safetensors.torch import load_file
from tiny import make_tiny_checkpoint

from pagellm.models.layers.fused_moe.block import SparseMoeBlock

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_prefill_and_decode_match_transformers(tied, tmp_path):
    path = make_tiny_checkpoint("granitemoe", tmp_path, tie_word_embeddings=tied)
    reference = load_reference(path)
    model = load_pagellm(path)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_stacked_experts_land_per_expert(tmp_path):
    """`input_linear` [E, 2I, H]: expert e's gate rows then its up rows; `output_linear` [E, H, I]."""
    path = make_tiny_checkpoint("granitemoe", tmp_path)
    full = load_file(str(path / "model.safetensors"))
    experts = load_pagellm(path).model.layers[1].mlp.experts
    w13, w2 = experts.w13, experts.w2  # not packed: load_pagellm leaves the experts to the reference
    torch.testing.assert_close(
        w13, full["model.layers.1.block_sparse_moe.input_linear.weight"], atol=0, rtol=0
    )
    torch.testing.assert_close(
        w2, full["model.layers.1.block_sparse_moe.output_linear.weight"], atol=0, rtol=0
    )
