"""Llama 4 against transformers on tiny checkpoints: logits through a prefill that crosses attention chunks
and decodes after it, with the features switched (no chunks, no q/k norm, no temperature, every layer MoE,
top 1), and the text of a `Llama4ForConditionalGeneration` checkpoint. Greedy parity through the engine
(chunked prefill, prefix-cache hits, preemption) is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint, make_tokenizer, randomise_vectors, tiny_config

from pagellm.models.llama4 import Llama4ForCausalLM, Llama4MoE, temperature_scales

ATOL = 1e-4
PROMPT = [(i * 37 + 11) % 380 + 3 for i in range(70)]  # 70 tokens: chunks of 32 end at 32 and 64
VARIANTS = {
    "llama4_text": {},
    "no-chunks-no-qk-norm-no-temperature": {
        "attention_chunk_size": None,
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
    },
    "every-layer-moe-top-1": {"interleave_moe_layer_step": 1, "num_experts_per_tok": 1},
}


def _check(model, reference, prompt) -> None:
    assert_decode_matches(model, reference, prompt, atol=ATOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("llama4_text", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    c = reference.config
    assert [isinstance(layer.mlp, Llama4MoE) for layer in model.model.layers] == [
        i in c.moe_layers for i in range(c.num_hidden_layers)
    ]
    chunks = [layer.self_attn.attn.spec.attention_chunk for layer in model.model.layers]
    assert chunks == [32 if t == "chunked_attention" else None for t in c.layer_types]
    _check(model, reference, PROMPT)


def test_the_text_of_a_multimodal_checkpoint(tmp_path):
    """`Llama4ForConditionalGeneration`: its decoder under `language_model.`, the vision tower skipped."""
    import transformers

    tokenizer = make_tokenizer(384)
    text = tiny_config("llama4_text", vocab_size=len(tokenizer)).to_dict()
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    full = transformers.Llama4ForConditionalGeneration(config)
    randomise_vectors(full)
    out = tmp_path / "tiny-llama4-mm"
    full.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model = load_pagellm(out)
    assert type(model).__name__ == "Llama4TextOfMultimodal"
    _check(model, full.language_model.eval(), PROMPT[:40])


def test_temperature_scales_are_transformers():
    positions = torch.arange(0, 300)
    expected = torch.log1p(torch.floor((positions.float() + 1.0) / 32)) * 0.1 + 1.0
    assert torch.equal(temperature_scales(positions, 32.0, 0.1), expected)
    assert temperature_scales(torch.tensor([30, 31]), 32.0, 0.1).tolist()[0] == 1.0


def test_the_backend_is_selected_for_the_chunked_layers():
    """Whatever layer comes first, the selector sees a chunked spec, so a backend without chunks is passed by."""
    config = tiny_config("llama4_text", vocab_size=400, no_rope_layers=[0, 1, 1, 1])
    assert config.layer_types[0] == "full_attention"
    assert Llama4ForCausalLM.selection_spec(config, torch.float32, 16).attention_chunk == 32


def test_prefix_hits_that_end_inside_a_chunk_through_the_engine(tmp_path):
    """Shared prefixes of 60 tokens: hits of 48 (3 blocks of 16) end inside the chunk 32..63, so the chunked
    groups must find block 2 (the chunk's first) and nothing before it; under a small cache, with
    preemption, greedy-identical to transformers."""
    from parity import Reference, assert_greedy_parity, chunked_llm, mixed_prompts

    path = make_tiny_checkpoint("llama4_text", tmp_path)
    reference = Reference(path, 12)
    llm = chunked_llm(path, 512, 48)
    prompts = mixed_prompts(300, seed=2, shared_prefix=60)
    assert_greedy_parity(llm, reference, prompts[:1])  # the first request fills the cache
    assert_greedy_parity(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 48 * (len(prompts) - 1)
    assert stats.num_preemptions > 0
