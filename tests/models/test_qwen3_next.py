"""Qwen3-Next and Qwen3.5 (Gated DeltaNet layers with a recurrent state per sequence, gated attention, MoE with a gated
shared expert) against transformers in float32: a batch mixing short and long prompts under chunked prefill
that cuts the states mid-sequence and preemption that drops them; the state cache's start-up choices."""

from __future__ import annotations

import logging

import pytest
from hybrid_checks import (
    assert_sampled_speculation_keeps_the_distribution,
    assert_speculation_keeps_greedy_output,
)
from parity import Reference, assert_greedy_parity, mixed_prompts, small_kv_cache
from tiny import make_tiny_checkpoint

from pagellm import LLM

MAX_TOKENS = 16
MAX_MODEL_LEN, TOKEN_BUDGET = 400, 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"))
    return path, Reference(path, MAX_TOKENS)


def test_matches_transformers_under_chunking_and_preemption(model, caplog):
    path, reference = model
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(
            str(path),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=small_kv_cache(path, MAX_MODEL_LEN, TOKEN_BUDGET),
            max_num_batched_tokens=TOKEN_BUDGET,  # prompts of up to 330 tokens: 7 chunks
            max_num_seqs=8,
        )
    assert "recurrent state: 3 layers" in caplog.text and "prefix caching off" in caplog.text
    prompts = mixed_prompts(300, seed=1)
    assert_greedy_parity(llm, reference, prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits == 0


def test_one_request_at_a_time_and_the_decode_path(model):
    """Whole prompts in one step, then decode steps that update every state at once (the vectorised path)."""
    path, reference = model
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=4)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=2)[:6])


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen3_5_matches_transformers(arch, tmp_path):
    """Qwen3.5 (dense, and with experts): the delta nets' projections come separate in the checkpoint."""
    path = make_tiny_checkpoint(arch, tmp_path)
    reference = Reference(path, MAX_TOKENS)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=4,
    )
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=4)[:8])


def test_speculative_decoding_keeps_the_greedy_output(model):
    path, reference = model
    assert_speculation_keeps_greedy_output(path, reference)


def test_sampled_speculative_decoding_keeps_the_distribution(model):
    assert_sampled_speculation_keeps_the_distribution(*model)


@pytest.mark.slow
def test_compiled_forward_matches_transformers(model):
    """torch.compile sees the projections and norms; the conv and delta rule stay one opaque op."""
    path, reference = model
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, enforce_eager=False)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=3)[:6])


def test_state_slots_take_at_most_half_the_kv_cache_budget(model, caplog):
    """With a budget (--kv-cache-space) the slots are --max-num-seqs lowered until the states fit in half
    of it; the scheduler runs no more requests than there are slots."""
    path, _ = model
    budget = 2**20  # 1 MiB (kv_cache_space in GiB)
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(str(path), dtype="float32", kv_cache_space=budget / 2**30, max_num_seqs=256)
    runner = llm.engine.runner
    per_sequence = sum(layer.state_spec().bytes for layer in runner.state_layers)
    assert runner.max_num_seqs == budget // 2 // per_sequence < 256
    assert llm.engine.scheduler.max_num_seqs == runner.max_num_seqs
    assert runner.state_caches[0][0].shape[0] == runner.max_num_seqs
    assert "at most half the KV cache budget" in caplog.text


def test_the_platforms_recurrent_kernels_run_in_place_of_the_references(model, monkeypatch, caplog):
    """`Platform.recurrent_kernels`: the fields a platform fills are what the layers call, decode and prefill."""
    from pagellm.core.state import RecurrentKernels
    from pagellm.models.layers.recurrent_kernels import REFERENCE
    from pagellm.platforms.cpu import CpuPlatform

    calls: list[str] = []

    def counted(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return getattr(REFERENCE, name)(*args, **kwargs)

        return kernel

    names = ("conv1d_update", "gated_delta_rule_update", "chunk_gated_delta_rule")
    kernels = RecurrentKernels(**{name: counted(name) for name in names})
    monkeypatch.setattr(CpuPlatform, "recurrent_kernels", classmethod(lambda cls: kernels))
    path, reference = model
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=4)
    assert "recurrent layers' kernels: " + ", ".join(names) in caplog.text
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=3)[:3])
    assert set(calls) == set(names)


@pytest.mark.parametrize(
    ("arch", "config_class", "model_class"),
    [
        ("qwen3_5_text", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
        pytest.param(
            "qwen3_5_moe_text",
            "Qwen3_5MoeConfig",
            "Qwen3_5MoeForConditionalGeneration",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_multimodal_checkpoints_text_model_runs_text_only(arch, config_class, model_class, tmp_path):
    """How Qwen3.5 ships: `*ForConditionalGeneration` with the decoder under `model.language_model.` and a
    vision tower beside it; the engine runs the decoder (its `text_config`) against transformers' own class."""
    import torch
    import transformers
    from tiny import make_tokenizer, tiny_config

    tokenizer = make_tokenizer(384)
    text = tiny_config(arch, vocab_size=len(tokenizer))
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=text.hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = getattr(transformers, config_class)(text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = Reference(tmp_path, MAX_TOKENS, auto_class="AutoModelForImageTextToText")
    assert type(reference.model).__name__ == model_class
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=4,
    )
    assert_greedy_parity(llm, reference, mixed_prompts(60, seed=5)[:3])
