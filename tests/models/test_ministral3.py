"""Ministral 3 against transformers on tiny checkpoints: the queries' position scale, logits through chunked
prefill and decode with a sliding window and a tied head, and a config without the scale's parameters
refused (Mistral 4's too). Greedy parity through the engine (the released shape: no window) is in
tests/engine/test_family_parity.py (FAMILIES["ministral3"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from tiny import make_tiny_checkpoint, tiny_config

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.position_scale import llama_4_scaling, position_log_scale
from pagellm.models.ministral3 import Ministral3ForCausalLM

ATOL = 1e-4


@pytest.mark.parametrize(("beta", "original"), [(0.1, 16384), (0.1, 32), (0.37, 7)])
def test_the_query_scale_is_transformers(beta, original):
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    positions = torch.arange(0, 200_000, 13)
    theirs = get_llama_4_attn_scale(positions[None, :], beta, original).flatten()
    assert torch.equal(position_log_scale(positions, beta, original), theirs)


def test_prefill_and_decode_match_transformers_with_a_window_and_a_tied_head(tmp_path):
    """A window of 32 and scale steps of 32 tokens, crossed several times by a 90-token prompt prefilled in
    two chunks; then decode steps."""
    path = make_tiny_checkpoint("ministral3", tmp_path, sliding_window=32, tie_word_embeddings=True)
    reference = load_reference(path)
    model = load_pagellm(path)
    assert model.tied and model.lm_head is model.model.embed_tokens
    assert {layer.self_attn.attn.spec.sliding_window for layer in model.model.layers} == {32}
    ids = [int(t) for t in torch.randint(3, 380, (90,), generator=torch.Generator().manual_seed(3))]
    assert_decode_matches(model, reference, ids, atol=ATOL, split=60)


@pytest.mark.parametrize("arch", ["ministral3", "mistral4"])
def test_a_config_without_the_scale_parameters_is_refused(arch):
    """Ministral 3's and Mistral 4's (whose queries are scaled alike): refused at start-up."""
    from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
    from pagellm.models.mistral4 import Mistral4ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = tiny_config(arch, vocab_size=384, rope_parameters=rope)
    with pytest.raises(ConfigError, match="llama_4_scaling_beta"):
        llama_4_scaling(config)
    model_class = {"ministral3": Ministral3ForCausalLM, "mistral4": Mistral4ForCausalLM}[arch]
    with pytest.raises(ConfigError, match="llama_4_scaling_beta"):
        model_class(ModelInit(config, torch.float32, TorchSDPABackend))


PIXTRAL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=16,
    image_size=64,
)
"""A tiny Pixtral tower: its weights are in the checkpoint and must be skipped."""


def mistral3_checkpoint(arch: str, path, **top_level) -> None:
    """A tiny `Mistral3ForConditionalGeneration` checkpoint (how Ministral 3 ships) with an `arch` decoder
    (tests/models/tiny.py), written by transformers with its tokenizer."""
    import transformers
    from tiny import make_tokenizer, randomise_vectors

    tokenizer = make_tokenizer(384)
    text = tiny_config(arch, vocab_size=len(tokenizer))
    config = transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=PIXTRAL, image_token_index=5, **top_level
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config)
    randomise_vectors(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_a_multimodal_checkpoints_decoder_runs_text_only(tmp_path):
    """Through the engine (chunked, prefix hits) against transformers' own multimodal class; the head tied
    by the top-level flag (Mistral3Config's default), the text config saying untied."""
    from parity import Reference, assert_greedy_parity, mixed_prompts, small_kv_cache

    from pagellm import LLM

    mistral3_checkpoint("ministral3", tmp_path)
    reference = Reference(tmp_path, 12, auto_class="AutoModelForImageTextToText")
    assert type(reference.model).__name__ == "Mistral3ForConditionalGeneration"
    assert (
        reference.model.config.tie_word_embeddings
        and not reference.model.config.text_config.tie_word_embeddings
    )
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=400,
        num_kv_blocks=small_kv_cache(tmp_path, 400, 48),
        max_num_batched_tokens=48,
        max_num_seqs=4,
    )
    prompts = mixed_prompts(300, seed=2, shared_prefix=40)
    assert_greedy_parity(llm, reference, prompts[:1])
    assert_greedy_parity(llm, reference, prompts[12:16])
    assert llm.engine.stats().prefix_cache_hits > 0


def test_a_multimodal_checkpoint_with_its_own_head(tmp_path):
    """Top-level tie_word_embeddings false: the checkpoint's own lm_head, logits through prefill and decode."""
    from transformers import AutoModelForImageTextToText

    mistral3_checkpoint("ministral3", tmp_path, tie_word_embeddings=False)
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load_pagellm(tmp_path)
    assert type(model).__name__ == "Ministral3TextOfMultimodal" and not model.tied
    ids = [int(t) for t in torch.randint(3, 380, (70,), generator=torch.Generator().manual_seed(4))]
    assert_decode_matches(model, reference, ids, atol=ATOL, steps=1)


def test_another_decoder_of_a_multimodal_checkpoint_is_refused():
    from pagellm.models.mistral3 import Mistral3ForConditionalGeneration

    text = tiny_config("mistral", 384)  # Mistral Small 3.1's decoder
    with pytest.raises(ConfigError, match="'mistral' decoder is not supported"):
        Mistral3ForConditionalGeneration.attention_spec(text, torch.float32, 16, 0)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_match_transformers(tmp_path, tp, pp):
    """On 2 gloo ranks: the query scale is per token, the same on every rank and stage."""
    from parity import assert_two_rank_parity

    assert_two_rank_parity("ministral3", tmp_path, 3, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@pytest.mark.slow
def test_lora_equals_peft_merged(tmp_path):
    """A PEFT adapter on every projection: greedy tokens equal peft's merged model's (the attention's
    own forward keeps Llama's projections, which carry the adapters)."""
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from peft_adapters import EVERY_PROJECTION, lora_engine

    base = make_tiny_checkpoint("ministral3", tmp_path)
    engine = lora_engine(base, tmp_path, EVERY_PROJECTION, seed=1, num_kv_blocks=400, max_lora_rank=4)
    assert_greedy_parity(engine, Reference(tmp_path / "merged", 12), mixed_prompts(300)[:8])
