"""ERNIE 4.5 MoE against transformers on tiny checkpoints: logits through prefill and decode (interleaved
rotary, dense layers around the sparse ones, the correction bias, shared experts), which layers have
experts, the multi-token-prediction weights skipped and `use_bias` refused. Greedy parity through the engine
is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_bf16_close, assert_decode_matches, load_pagellm, load_reference
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError
from pagellm.models.layers.fused_moe.block import SparseMoeBlock

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
VARIANTS = {
    "end-index": {},  # layers 1-2 sparse
    # every second layer from 0 to the end (1, 3), no shared experts, tied embeddings
    "interval-2-unshared-tied": {
        "moe_layer_start_index": 0,
        "moe_layer_end_index": -1,
        "moe_layer_interval": 2,
        "moe_num_shared_experts": 0,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock

    path = make_tiny_checkpoint("ernie4_5_moe", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [isinstance(layer.mlp, Ernie4_5_MoeSparseMoeBlock) for layer in reference.model.layers]
    assert any(sparse) and not all(sparse)
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_correction_bias_is_loaded_and_mtp_weights_skipped(tmp_path):
    path = make_tiny_checkpoint("ernie4_5_moe", tmp_path)
    file = path / "model.safetensors"
    state = load_file(str(file))
    bias = state["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    state["model.mtp_linear_proj.0.weight"] = torch.randn(64, 128)  # as the released checkpoints carry
    save_file(state, str(file), metadata={"format": "pt"})
    model = load_pagellm(path)
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias.reshape(-1))


def test_use_bias_is_refused(tmp_path):
    path = make_tiny_checkpoint("ernie4_5_moe", tmp_path, use_bias=True)
    with pytest.raises(ConfigError, match="use_bias"):
        load_pagellm(path)


def test_bfloat16_model_stays_close_to_transformers_bfloat16(tmp_path):
    """The router stays float32 and the rotary runs in float32, as transformers keeps them."""
    path = make_tiny_checkpoint("ernie4_5_moe", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert_bf16_close(model, reference, PROMPT, atol=0.15)
