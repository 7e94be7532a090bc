"""Command R7B / Command A (Cohere2) against transformers on tiny checkpoints: logits through prefill and
decode for the released shape (3 window layers with interleaved rotary : 1 global layer without) and for
q/k/v/o biases, an untied head and another layer pattern; bfloat16, where transformers rotates in float32;
under -m slow, greedy parity on two ranks (tensor or pipeline parallel) and with a LoRA adapter. Greedy
parity through the engine (chunked prefill, prefix-cache hits, preemption, KV cache groups) is
tests/engine/test_family_parity.py (FAMILIES["cohere2"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_bf16_close, assert_decode_matches, load_pagellm, load_reference
from parity import Reference, assert_greedy_parity, assert_two_rank_parity, mixed_prompts
from peft_adapters import EVERY_PROJECTION, assert_adapter_changes_outputs, lora_engine
from session_device import session_device
from tiny import make_tiny_checkpoint

from pagellm.models.layers.rotary import rotate_pairs

ATOL = 1e-4
PROMPT = [(7 * i + 5) % 380 + 3 for i in range(45)]  # longer than the window of 32
ALTERNATING = ["sliding_attention", "full_attention"] * 2
VARIANTS = {
    "cohere2": {},
    "cohere2-biases-untied-alternating": {
        "attention_bias": True,
        "tie_word_embeddings": False,
        "layer_types": ALTERNATING,
        "logit_scale": 0.0625,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("cohere2", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    config = reference.config
    sliding = [t == "sliding_attention" for t in config.layer_types]
    assert [a.spec.sliding_window == 32 for a in model.attention_layers()] == sliding
    assert [layer.self_attn.rotates for layer in model.model.layers] == sliding  # NoPE on the global ones
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == config.attention_bias
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


def test_interleaved_rotary_is_transformers():
    """Pairs (x0, x1), (x2, x3), ... rotate by frequencies 0, 1, ...: transformers' rotate_half over
    repeat_interleave'd cos/sin."""
    from transformers.models.cohere2.modeling_cohere2 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    angles = torch.randn(5, 8, generator=gen) * 3
    cos, sin = angles.cos(), angles.sin()
    full_cos, full_sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1), k.transpose(0, 1), full_cos, full_sin, unsqueeze_dim=0
    )
    torch.testing.assert_close(rotate_pairs(q, cos, sin, round_cos_sin=True), expected_q.transpose(0, 1))
    torch.testing.assert_close(rotate_pairs(k, cos, sin, round_cos_sin=True), expected_k.transpose(0, 1))


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    """transformers rotates q and k in float32 (cos and sin rounded to bfloat16 first) and normalises in
    float32; on the CPU the logits are then the same to the bit (rotating in bfloat16 would be off by about
    0.01 here), elsewhere close."""
    path = make_tiny_checkpoint("cohere2", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    atol = 0.0 if session_device().type == "cpu" else 0.05
    assert_bf16_close(model, reference, PROMPT, atol=atol)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_greedy_parity_on_two_ranks(tmp_path, tp, pp):
    # the KV cache over the window layers' and the global layer's groups
    assert_two_rank_parity("cohere2", tmp_path, 2, 400, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.slow
def test_lora_adapter_outputs_equal_peft_merged(tmp_path):
    """A PEFT adapter on every projection of the parallel block: greedy outputs equal peft's
    merge_and_unload() model's."""
    base = make_tiny_checkpoint("cohere2", tmp_path)
    engine = lora_engine(base, tmp_path, EVERY_PROJECTION)
    prompts = mixed_prompts(300)[:6]
    assert_greedy_parity(engine, Reference(tmp_path / "merged", 8), prompts)
    assert_adapter_changes_outputs(engine, prompts)
