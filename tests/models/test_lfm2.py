"""LFM2 and LFM2-MoE (gated short convolutions with a conv window per sequence beside attention with q/k norms;
routed experts after the dense layers) against transformers in float32: logits of two sequences prefilled in
chunks that continue the windows, then decoded together (the vectorised window update), with and without the
conv biases; greedy parity through the engine under chunked prefill and preemption (prefix caching is off
for recurrent models); GGUF files refused; under -m slow, every mixed prompt that way, the compiled forward,
and LoRA on q/k/v (one on the MLP refused)."""

from __future__ import annotations

import pytest
import torch
from hybrid_checks import (
    assert_chunked_prefill_and_decode_match,
    assert_compiled_forward_matches,
    assert_engine_parity_under_preemption,
    assert_every_mixed_prompt_matches,
    assert_speculation_refused,
)
from models_harness import load_pagellm, load_reference
from parity import Reference, assert_greedy_parity, mixed_prompts
from peft_adapters import assert_adapter_refused, lora_engine, make_peft_adapter
from tiny import make_tiny_checkpoint, tiny_config

from pagellm.core.errors import ConfigError
from pagellm.models.gguf_config import fill_gguf_config

PROMPTS = {0: [(7 * i + 5) % 380 + 3 for i in range(45)], 1: [(11 * i + 2) % 380 + 3 for i in range(21)]}
CHUNK = 8  # prefill steps of 8 tokens, each continuing the windows the one before left
VARIANTS = {
    "lfm2": {},
    # the released models' kind: no biases on the conv or its projections; an output projection of its own
    "lfm2-no-bias-untied": {"conv_bias": False, "tie_word_embeddings": False},
    # a dense layer, then experts: sigmoid routing with the expert bias in the choice, renormalised and scaled
    "lfm2_moe": {},
}
MLP_WIDTH = {"lfm2": 128, "lfm2_moe": 96}  # LFM2's adjusted from 128 (tests/models/tiny.py); LFM2-MoE's not
MAX_TOKENS = 16
LENGTHS = (1, 17, 33, 100, 200, 330)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_batched_decode_match_transformers(variant, tmp_path):
    arch = variant.split("-")[0]
    path = make_tiny_checkpoint(arch, tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    assert len(model.attention_layers()) == 1 and len(model.state_layers()) == 3
    assert model.model.layers[0].feed_forward.down_proj.in_features == MLP_WIDTH[arch]
    assert (model.model.layers[0].conv.conv.bias is not None) == reference.config.conv_bias
    assert (model.lm_head is model.model.embed_tokens) == reference.config.tie_word_embeddings
    if arch == "lfm2_moe":  # the block's expert bias is the router's correction bias
        want = reference.model.layers[3].feed_forward.expert_bias
        torch.testing.assert_close(model.model.layers[3].feed_forward.gate.e_score_correction_bias, want)
    assert_chunked_prefill_and_decode_match(model, reference, PROMPTS, CHUNK)
    # 1-token steps from the start: windows (2 inputs) filled by prefills shorter than them
    assert_chunked_prefill_and_decode_match(model, reference, {0: PROMPTS[0][:3], 1: PROMPTS[1][:1]}, 1)


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, Reference(path, MAX_TOKENS)


def test_matches_transformers_under_chunking_and_preemption(model, caplog):
    assert_engine_parity_under_preemption(*model, 3, LENGTHS, caplog)


@pytest.mark.slow
def test_every_mixed_prompt_under_chunking_and_preemption(model):
    assert_every_mixed_prompt_matches(*model)


@pytest.mark.slow
def test_compiled_forward_matches_transformers(model):
    """torch.compile sees the projections, gates and norms; the conv stays one opaque op."""
    assert_compiled_forward_matches(*model, seed=4, count=6)


@pytest.mark.slow
def test_lora_on_q_k_v_equals_peft_merged_and_on_the_mlp_is_refused(tmp_path):
    """A PEFT adapter on q/k/v: greedy outputs equal peft's merged model's. One on w1 (LFM2's MLP gate, no
    LoRA target of pagellm's) is refused when it is added, naming the module."""
    path = make_tiny_checkpoint("lfm2", tmp_path)
    with_adapter = lora_engine(path, tmp_path / "a", ["q_proj", "k_proj", "v_proj"])
    prompts = mixed_prompts(300)[:6]
    assert_greedy_parity(with_adapter, Reference(tmp_path / "a" / "merged", 8), prompts)
    mlp = make_peft_adapter(path, tmp_path / "m", ["w1"], merged=False)
    assert_adapter_refused(with_adapter.llm, mlp, prompts, "w1")


class _Lfm2GGUF:
    """What fill_gguf_config reads of a GGUF file: its architecture."""

    tensors = ()

    def get_field(self, key: str):
        if key != "general.architecture":
            return None
        return type("Field", (), {"contents": lambda self: "lfm2"})()


def test_a_gguf_file_is_refused_at_start():
    """transformers reads LFM2 GGUF files, but no conversion of one is checked: refused, saying so."""
    with pytest.raises(ConfigError, match="LFM2 GGUF files are not supported"):
        fill_gguf_config(tiny_config("lfm2", 384), _Lfm2GGUF())


def test_speculative_decoding_is_refused_at_start_up(model):
    """Its short convolutions keep no way back from a rejected draft (the delta-rule layers do)."""
    assert_speculation_refused(model[0], "ShortConv")
