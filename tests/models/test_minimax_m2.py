"""MiniMax-M2 against transformers on tiny checkpoints: logits through prefill and decode (q/k norms over the
whole projections, partial rotary, sigmoid routing with the correction bias), the multi-token-prediction
layers skipped, and the original configs' fields that transformers ignores refused where they depart from
M2. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference, set_config_fields
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint, tiny_config

from pagellm.core.errors import ConfigError
from pagellm.models.gguf_config import fill_gguf_config

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]


@pytest.mark.parametrize("rotary_dim", [8, 16], ids=["partial-rotary", "full-rotary"])
def test_prefill_and_decode_match_transformers(rotary_dim, tmp_path):
    path = make_tiny_checkpoint("minimax_m2", tmp_path, rotary_dim=rotary_dim)
    reference = load_reference(path)
    model = load_pagellm(path)
    assert model.model.rotary_emb.inv_freq.numel() == rotary_dim // 2
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_correction_bias_is_loaded_and_mtp_layers_skipped(tmp_path):
    path = make_tiny_checkpoint("minimax_m2", tmp_path)
    file = path / "model.safetensors"
    state = load_file(str(file))
    bias = state["model.layers.1.block_sparse_moe.e_score_correction_bias"]
    # the released checkpoints' MTP modules sit past the decoder layers
    state["model.layers.2.self_attn.q_proj.weight"] = torch.randn(64, 64)
    save_file(state, str(file), metadata={"format": "pt"})
    model = load_pagellm(path)
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias)


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"attn_type_list": [0, 1]}, "lightning-attention"),
        ({"qk_norm_type": "per_head"}, "q/k norms"),
        ({"shared_intermediate_size": 64}, "shared experts"),
        ({"scoring_func": "softmax"}, "routing by 'softmax'"),
    ],
)
def test_original_config_fields_transformers_ignores_are_refused(fields, reason, tmp_path):
    path = make_tiny_checkpoint("minimax_m2", tmp_path)
    set_config_fields(path, fields)
    with pytest.raises(ConfigError, match=reason):
        load_pagellm(path)


class _MiniMaxM2GGUF:
    """The part of a GGUF reader `fill_gguf_config` reads: a `minimax-m2` file's architecture."""

    tensors = ()

    def get_field(self, key: str):
        if key != "general.architecture":
            return None
        return type("Field", (), {"contents": lambda self: "minimax-m2"})()


def test_a_gguf_file_is_refused_at_start():
    with pytest.raises(ConfigError, match="MiniMax-M2 GGUF files are not supported"):
        fill_gguf_config(tiny_config("minimax_m2", 384), _MiniMaxM2GGUF())


@pytest.mark.slow
def test_the_block_fp8_release_format_loads(tmp_path):
    """MiniMax-M2 ships block-wise fp8 (blocks of 128 x 128; 16 x 16 here): attention and experts requantized
    per row as they load, the router float as its modules_to_not_convert says; greedy-identical to
    transformers on the weights as pagellm keeps them (pagellm/quantization/fp8_blocks.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from quant_formats import fp8_block_quantizer, is_quantized, write_quantized

    from pagellm import LLM
    from pagellm.models.layers.fused_moe.layer import FusedMoE

    src = make_tiny_checkpoint("minimax_m2", tmp_path)
    config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [16, 16],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }

    def select(name: str, tensor: torch.Tensor) -> bool:
        return is_quantized(name, tensor) and not name.endswith(".block_sparse_moe.gate.weight")

    path = tmp_path / "fp8"
    kept = write_quantized(src, path, fp8_block_quantizer((16, 16), True), config, select)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=400)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(layer.weight_dtype == torch.float8_e4m3fn for layer in experts)
    assert_greedy_parity(llm, Reference(kept, 8), mixed_prompts(300)[:4])
