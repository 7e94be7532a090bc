"""LFM3 (LFM2's gated short convolutions beside sliding and full attention, a rope per attention kind with the
full layers' proportional, a sigmoid gate per attention head, sandwich norms, an unadjusted MLP) against
transformers in float32: logits of two sequences prefilled in chunks that cross the window and continue the
conv windows, then decoded together, as released (gate, sandwich norms, tied) and with every switch the other
way (biases, no gate, no sandwich norms, untied); greedy parity through the engine under chunked prefill and
preemption (prefix caching is off for recurrent models); speculative decoding, tensor parallelism and
length-dependent ropes refused; under -m slow, every mixed prompt that way, the compiled forward, and LoRA
on q/k/v/o (one on the gate refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_checks import (
    assert_chunked_prefill_and_decode_match,
    assert_compiled_forward_matches,
    assert_engine_parity_under_preemption,
    assert_every_mixed_prompt_matches,
    assert_parallelism_refused,
    assert_speculation_refused,
)
from models_harness import load_pagellm, load_reference
from parity import Reference, assert_greedy_parity, mixed_prompts
from peft_adapters import (
    assert_adapter_changes_outputs,
    assert_adapter_refused,
    lora_engine,
    make_peft_adapter,
)
from tiny import make_tiny_checkpoint, tiny_config

from pagellm.core.errors import ConfigError
from pagellm.models.lfm3 import rope_config

PROMPTS = {0: [(7 * i + 5) % 380 + 3 for i in range(45)], 1: [(11 * i + 2) % 380 + 3 for i in range(21)]}
CHUNK = 8  # prefill steps of 8 tokens: the 45-token prompt crosses the window of 24 mid-prefill
VARIANTS = {
    "released": {},
    # every switch the other way: biases on the attention and the conv, no gate, no sandwich norms, untied
    "plain": {
        "attention_bias": True,
        "conv_bias": True,
        "use_attention_gate": False,
        "use_sandwich_norm": False,
        "tie_word_embeddings": False,
    },
}
MAX_TOKENS = 16
LENGTHS = (1, 17, 33, 100, 200, 330)


@pytest.fixture(scope="module")
def lfm3(tmp_path_factory) -> tuple[Path, Reference]:
    """The released configuration's checkpoint and its oracle, shared by the engine tests."""
    path = make_tiny_checkpoint("lfm3", tmp_path_factory.mktemp("lfm3"))
    return path, Reference(path, MAX_TOKENS)


def assert_built_as_configured(model, config) -> None:
    """The layers the config asks for: a window on the sliding layer only, the full layer's proportional
    rope (half its frequencies zero), the gate, the sandwich norms, the biases and the tied head."""
    assert [a.spec.sliding_window for a in model.attention_layers()] == [24, None]
    assert len(model.state_layers()) == 3
    full = model.model.rotaries[model.model.layer_rope[3]].inv_freq
    assert (full == 0).sum() == 4 and (model.model.rotaries[model.model.layer_rope[1]].inv_freq > 0).all()
    attention, conv = model.model.layers[1], model.model.layers[0]
    assert (attention.self_attn.g_proj is not None) == config.use_attention_gate
    assert isinstance(conv.post_ffn_norm, torch.nn.Identity) != config.use_sandwich_norm
    assert (attention.self_attn.qkv_proj.bias is not None) == config.attention_bias
    assert (conv.conv.conv.bias is not None) == config.conv_bias
    assert conv.feed_forward.down_proj.in_features == 96
    assert (model.lm_head is model.model.embed_tokens) == config.tie_word_embeddings


@pytest.mark.parametrize(
    "variant", ["released", pytest.param("plain", marks=pytest.mark.slow)], ids=list(VARIANTS)
)
def test_chunked_prefill_and_batched_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("lfm3", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    assert_built_as_configured(model, reference.config)
    assert_chunked_prefill_and_decode_match(model, reference, PROMPTS, CHUNK)
    # 1-token steps from the start: conv windows (2 inputs) filled by prefills shorter than them
    assert_chunked_prefill_and_decode_match(model, reference, {0: PROMPTS[0][:3], 1: PROMPTS[1][:1]}, 1)


def test_matches_transformers_under_chunking_and_preemption(lfm3, caplog):
    """Three conv windows in the state cache beside two KV cache groups (the sliding layer's and the full's)."""
    assert_engine_parity_under_preemption(*lfm3, 3, LENGTHS, caplog)


@pytest.mark.slow
def test_every_mixed_prompt_eager_and_compiled(lfm3):
    """Every mixed prompt under chunking and preemption; then six through torch.compile, which sees the
    projections, gates and norms (the conv stays one opaque op)."""
    assert_every_mixed_prompt_matches(*lfm3)
    assert_compiled_forward_matches(*lfm3, seed=4, count=6)


@pytest.mark.slow
def test_lora_on_attention_equals_peft_merged_and_on_the_gate_is_refused(tmp_path):
    """An adapter on g_proj (no LoRA target of pagellm's) is refused when it is added, naming the module,
    and the engine goes on: with a PEFT adapter on q/k/v/o, greedy outputs equal peft's merged model's
    (o_proj takes the gated heads, as transformers' does) and differ from the base model's."""
    path = make_tiny_checkpoint("lfm3", tmp_path)
    gate = make_peft_adapter(path, tmp_path / "g", ["g_proj"], merged=False)
    engine = lora_engine(path, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = mixed_prompts(300)[:6]
    assert_adapter_refused(engine.llm, gate, prompts, "g_proj")
    assert_greedy_parity(engine, Reference(tmp_path / "a" / "merged", 8), prompts)
    assert_adapter_changes_outputs(engine, prompts)


def test_speculative_decoding_and_tensor_parallelism_are_refused_at_start_up(lfm3):
    """Its short convolutions keep no way back from a rejected draft, nor a split of their channels."""
    assert_speculation_refused(lfm3[0], "ShortConv")
    assert_parallelism_refused(lfm3[0], "short-conv layers")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_length_dependent_rope_is_refused(rope_type):
    """Their per-token lengths are wired for one rope in the model, and LFM3 has one per attention kind."""
    config = tiny_config("lfm3", 384)
    config.rope_parameters["full_attention"] = {"rope_type": rope_type, "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(ConfigError, match=f"rope type '{rope_type}' on its full_attention layers"):
        rope_config(config, "full_attention")
