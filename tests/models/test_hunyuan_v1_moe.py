"""Hunyuan MoE against transformers on tiny checkpoints: logits through prefill and decode (q/k norms after
the rotary, the NTK-alpha rope, a shared MLP beside the experts, top k per layer or one for all, a plain
rope), and the original configs' fields that transformers ignores refused where they depart from
Hunyuan-A13B. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference, set_config_fields
from tiny import make_tiny_checkpoint

from pagellm.core.errors import ConfigError

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
VARIANTS = {
    "ntk-alpha-topk-per-layer": {},
    "plain-rope-one-topk-tied": {
        "moe_topk": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("hunyuan_v1_moe", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    top_k = [layer.mlp.gate.routing.top_k for layer in model.model.layers]
    assert top_k == [layer.mlp.gate.top_k for layer in reference.model.layers]
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"use_cla": True, "cla_share_factor": 2}, "cross-layer attention"),
        ({"use_qk_norm": False}, "no q/k norms"),
        ({"num_shared_expert": [1, 2, 1]}, "one shared expert"),
        ({"moe_intermediate_size": [32, 48, 32]}, "another width"),
        ({"moe_layer_num_skipped": 1}, "dense layers"),
        ({"use_mixed_mlp_moe": False}, "no shared MLP"),
    ],
)
def test_original_config_fields_transformers_ignores_are_refused(fields, reason, tmp_path):
    path = make_tiny_checkpoint("hunyuan_v1_moe", tmp_path)
    set_config_fields(path, fields)
    with pytest.raises(ConfigError, match=reason):
        load_pagellm(path)


def test_released_shape_of_the_original_fields_is_accepted(tmp_path):
    """Hunyuan-A13B's own values of those fields (per-layer lists) load."""
    path = make_tiny_checkpoint("hunyuan_v1_moe", tmp_path)
    released = {
        "use_cla": False,
        "use_qk_norm": True,
        "use_rotary_pos_emb": True,
        "use_mixed_mlp_moe": True,
        "num_shared_expert": [1, 1, 1],
        "moe_intermediate_size": [32, 32, 32],
        "moe_layer_num_skipped": 0,
        "mlp_bias": False,
    }
    set_config_fields(path, released)
    load_pagellm(path)
