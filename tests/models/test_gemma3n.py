"""Gemma 3n against transformers on tiny checkpoints: logits through prefill and decode (AltUp, LAuReL,
activation sparsity, per-layer inputs, shared KV) and with its switches, the text model of a multimodal
checkpoint's layout, and the KV cache of its shared-KV layers. Greedy parity through the engine (chunked
prefill, prefix hits, preemption) is tests/engine/test_family_parity.py's "gemma3n_text"."""

from __future__ import annotations

import json

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference, set_config_fields
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.setup import resolve_engine

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33] * 4  # past the window; ids past the table
VARIANTS = {
    "default": {},
    # two streams, no correction scale, every layer sparse, no shared KV, another soft-cap
    "switches": {
        "altup_num_inputs": 2,
        "altup_correct_scale": False,
        "activation_sparsity_pattern": [0.9] * 10,
        "num_kv_shared_layers": 0,
        "final_logit_softcapping": 15.0,
    },
}


def _check_logits(path, reference) -> None:
    assert_decode_matches(load_pagellm(path), reference, PROMPT, atol=ATOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("gemma3n_text", tmp_path, **VARIANTS[variant])
    _check_logits(path, load_reference(path))


def test_text_of_a_multimodal_checkpoint(tmp_path):
    """`Gemma3nForConditionalGeneration`'s layout (how Gemma 3n ships: the decoder under
    `model.language_model.`, a `text_config`), made from a text checkpoint by renaming its tensors (the
    vision tower needs timm), with a tower tensor beside it that must not be read; its logits are the text
    model's."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint("gemma3n_text", tmp_path)
    reference = load_reference(path)
    weights = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(path / "model.safetensors").items()
    }
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(4, 3, 3, 3)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    config = {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": text,
    }
    (path / "config.json").write_text(json.dumps(config))
    assert load_pagellm(path).__class__.__name__ == "Gemma3nTextOfMultimodal"
    _check_logits(path, reference)


def test_shared_kv_layers_hold_no_cache(tmp_path):
    """Layers 7-9 read the KV of layers 6 (sliding) and 4 (full): no group, no tensor of their own."""
    path = make_tiny_checkpoint("gemma3n_text", tmp_path)
    layout = resolve_engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256)).kv_layout
    assert layout.readers == ((7, 6), (8, 6), (9, 4))
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(7))
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=256)
    caches = llm.engine.runner.kv_caches
    assert caches[7] is caches[6] and caches[8] is caches[6] and caches[9] is caches[4]
    assert len({id(c) for c in caches}) == layout.num_tensors == layout.layers_per_block


def test_every_layer_sharing_is_refused(tmp_path):
    """With every layer reading KV (transformers' own config refuses it too), start-up says why."""
    path = make_tiny_checkpoint("gemma3n_text", tmp_path, num_kv_shared_layers=3)
    set_config_fields(path, {"num_kv_shared_layers": 10})
    with pytest.raises(ConfigError, match="num_kv_shared_layers 10 of 10 layers"):
        LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=16)
