"""GLM-4 dense against transformers on tiny checkpoints: logits through prefill and decode with half of each
head rotating in interleaved pairs (as released) and with all of it (no biases, a tied head); a
tensor-parallel rank's rows of the checkpoint's fused gate_up; a pre-quantized fused tensor refused. Greedy
parity through the engine (chunked prefill, prefix-cache hits, preemption) is
tests/engine/test_family_parity.py (FAMILIES["glm4"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from safetensors.torch import load_file
from tiny import make_tiny_checkpoint
from transformers import AutoConfig

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.errors import ConfigError
from pagellm.distributed import Group, Parallel
from pagellm.models.base import ModelInit
from pagellm.models.layers.rotary import pairs_to_halves
from pagellm.models.loader import iter_checkpoint_weights, load_model

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]
VARIANTS = {
    "glm4": {},
    "glm4-whole-rotary-no-bias-tied": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("glm4", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    attn = model.model.layers[0].self_attn
    assert attn.rotated == int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
    assert (attn.qkv_proj.bias is not None) == config.attention_bias and attn.o_proj.bias is None
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_pairs_to_halves_moves_only_the_rotating_features():
    x = torch.arange(8.0).view(1, 1, 8)
    assert pairs_to_halves(x, 4).flatten().tolist() == [0, 2, 1, 3, 4, 5, 6, 7]


def test_a_tensor_parallel_rank_reads_its_rows_of_the_fused_gate_up(tmp_path):
    """Rank 1 of 2: the second half of gate's rows and of up's, from the checkpoint's one gate_up tensor."""
    path = make_tiny_checkpoint("glm4", tmp_path)  # MLP 128: gate rows 0-127, up rows 128-255
    full = load_file(str(path / "model.safetensors"))["model.layers.1.mlp.gate_up_proj.weight"]
    parallel = Parallel(tp=Group(size=2, rank=1, ranks=[0, 1]))
    init = ModelInit(AutoConfig.from_pretrained(path), torch.float32, TorchSDPABackend, parallel=parallel)
    model = load_model("pagellm.models.glm4:Glm4ForCausalLM", init, iter_checkpoint_weights(path), "cpu")
    got = model.model.layers[1].mlp.gate_up_proj.weight
    torch.testing.assert_close(got, torch.cat([full[64:128], full[192:]]), rtol=0, atol=0)


def test_a_pre_quantized_fused_tensor_is_refused(tmp_path):
    model = load_pagellm(make_tiny_checkpoint("glm4", tmp_path))
    with pytest.raises(ConfigError, match="pre-quantized GLM-4 checkpoints"):
        model.load_weights([("model.layers.0.mlp.gate_up_proj.qweight", torch.zeros(4, 4))])
