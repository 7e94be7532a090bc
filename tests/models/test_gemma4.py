"""Gemma 4 against transformers on tiny checkpoints: logits through prefill and decode for the dense form
(per-layer head sizes, K = V, shared KV, per-layer inputs), the MoE form and the config switches, the text
model of a multimodal checkpoint, and the KV cache of a model with shared-KV layers: the layers that read
another layer's cache hold no tensor and no block. Greedy parity through the engine (chunked prefill,
prefix hits, preemption) is tests/engine/test_family_parity.py's "gemma4_text"."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from parity import GEMMA4_MOE
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.setup import resolve_engine

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33] * 4  # 52 tokens: past the window of 32
VARIANTS = {
    "dense": {},
    "moe": GEMMA4_MOE,
    # full layers with their own v_proj and the sliding layers' KV heads, MLPs of one width, no soft-cap
    "k-apart-from-v": {
        "attention_k_eq_v": False,
        "num_global_key_value_heads": None,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": None,
    },
}


def _check_logits(path, reference) -> None:
    model = load_pagellm(path)
    assert_decode_matches(model, reference, PROMPT, atol=ATOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("gemma4_text", tmp_path, **VARIANTS[variant])
    _check_logits(path, load_reference(path))


def test_text_of_a_multimodal_checkpoint(tmp_path):
    """`Gemma4ForConditionalGeneration` (how Gemma 4 ships): its decoder under `model.language_model.`, run
    for text alone, equals transformers' multimodal class on text."""
    import transformers
    from tiny import make_tokenizer, randomise_vectors, tiny_config

    tokenizer = make_tokenizer(384)
    text = tiny_config("gemma4_text", vocab_size=len(tokenizer))
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config)
    randomise_vectors(model)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert load_pagellm(tmp_path).__class__.__name__ == "Gemma4ForConditionalGeneration"
    _check_logits(tmp_path, model.eval())


def _runner(path, **kwargs):
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=4, **kwargs)
    return llm, llm.engine.runner


def test_shared_kv_layers_hold_no_cache(tmp_path):
    """Layers 5-7 read the KV of layers 2 (full) and 4 (sliding): they join no group and get their source's
    tensor; the full and sliding layers' caches have their own shapes and pages (1 KV head of 64 and 2 of
    16). A block then costs one full and one sliding layer's page, a third of what the same model without
    sharing pays (3 groups of 3 layers: 3 tensors of each shape)."""
    path = make_tiny_checkpoint("gemma4_text", tmp_path)
    layout = resolve_engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256)).kv_layout
    assert layout.readers == ((5, 2), (6, 4), (7, 2))
    assert [g.layers for g in layout.groups] == [(2,), (0,), (1,), (3,), (4,)]
    assert layout.num_tensors == 2
    assert layout.describe() == (
        "KV cache: 5 groups of 1 layer: full (1 layer), sliding window 32 (4 layers); "
        "3 layers reading another layer's cache, keeping none"
    )
    llm, runner = _runner(path)
    caches = runner.kv_caches
    assert caches[5] is caches[2] and caches[7] is caches[2] and caches[6] is caches[4]
    assert len({id(c) for c in caches}) == 2
    sliding_page = 2 * runner.block_size * 2 * 16 * 4  # K and V rows, 2 heads of 16 float32 per token
    full_page = 2 * sliding_page  # 1 head of 64
    assert caches[2].numel() * 4 == runner.num_blocks * full_page
    assert caches[0].numel() * 4 == runner.num_blocks * sliding_page
    block = full_page + sliding_page
    assert runner.block_bytes() == block
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_groups == 5

    unshared = make_tiny_checkpoint("gemma4_text", tmp_path / "unshared", num_kv_shared_layers=0)
    llm, runner = _runner(unshared)
    assert len({id(c) for c in runner.kv_caches}) == 6 and runner.block_bytes() == 3 * block
    assert llm.engine.scheduler.kv_cache_manager.num_groups == 3
    # the start-up line's concurrency in the same memory (`max_concurrency`): 3 times the blocks, each
    # request of 128 tokens holding 20 (8 full, 3 in each of 4 windowed tables) against 14 (8, 3 and 3)
    space = 384 * block / 2**30
    managers = [
        LLM(
            str(p), dtype="float32", max_model_len=128, kv_cache_space=space
        ).engine.scheduler.kv_cache_manager
        for p in (path, unshared)
    ]
    assert [m.num_blocks for m in managers] == [384, 128]
    assert [m.max_blocks_per_request(128) for m in managers] == [20, 14]
    assert [m.max_concurrency(128) for m in managers] == [383 / 20, 127 / 14]  # 19.2 against 9.1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_kv_shared_layers": 8}, "num_kv_shared_layers 8 of 8 layers"),
    ],
)
def test_refused_at_start_up(overrides, message, tmp_path):
    path = make_tiny_checkpoint("gemma4_text", tmp_path, **overrides)
    with pytest.raises(ConfigError, match=message):
        LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=16)


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma3n_text"])
def test_lora_equals_peft_merged(arch, tmp_path):
    """A PEFT adapter on every projection it finds (q/o only on the shared-KV layers, no v on Gemma 4's K = V
    layers): greedy outputs equal peft's merge_and_unload() model's, for Gemma 4 and Gemma 3n (whose
    attention is Gemma 4's)."""
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from peft_adapters import EVERY_PROJECTION, lora_engine

    base = make_tiny_checkpoint(arch, tmp_path)
    engine = lora_engine(base, tmp_path, EVERY_PROJECTION, seed=4, num_kv_blocks=400, max_lora_rank=4)
    assert_greedy_parity(engine, Reference(tmp_path / "merged", 12), mixed_prompts(300)[:6])
