"""KV cache groups (core/kv_cache_spec.py): layers grouped by KV spec, one block table per group, and
sliding-window groups that free the blocks behind their window while a request runs, greedy-identical to
transformers. The manager's own rules are in test_kv_cache_manager.py; the combined family check
(chunked prefill, prefix hits, preemption) of a mixed model is "qwen3-mixed-windows" in
tests/models/parity.py FAMILIES."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core.attention import AttentionSpec
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.kv_cache_spec import group_layers
from pagellm.engine.setup import resolve_engine

MAX_TOKENS = 16
THREE_TO_ONE = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def _spec(window=None, head_size=16, kv_heads=2):
    return AttentionSpec(4, kv_heads, head_size, torch.float32, 16, sliding_window=window)


def test_layers_are_grouped_by_spec_in_groups_of_equal_size():
    one = group_layers([_spec()] * 3)
    assert one.windows == (None,) and one.groups[0].layers == (0, 1, 2) and one.layers_per_block == 3
    assert one.describe() == "KV cache: 1 group of 3 layers: full (3 layers)"
    # 3 window layers : 1 full layer: four groups of one layer, the full one first; they share one tensor
    mixed = group_layers([_spec(32), _spec(), _spec(32), _spec(32)])
    assert mixed.windows == (None, 32, 32, 32) and mixed.layers_per_block == 1
    assert [g.layers for g in mixed.groups] == [(1,), (0,), (2,), (3,)]
    assert {mixed.tensor_of(i) for i in range(4)} == {0}
    assert mixed.describe() == "KV cache: 4 groups of 1 layer: full (1 layer), sliding window 32 (3 layers)"
    # 2 : 4 layers: groups of 2, a kind's layers interleaved (a pipeline stage's layers spread over them)
    two = group_layers([_spec(), _spec(8), _spec(8), _spec(), _spec(8), _spec(8)])
    assert [g.layers for g in two.groups] == [(0, 3), (1, 4), (2, 5)] and two.layers_per_block == 2
    assert [two.tensor_of(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]
    # 5 : 6: close enough for one group each, the smaller padded
    close = group_layers([_spec()] * 5 + [_spec(8)] * 6)
    assert close.num_groups == 2 and close.layers_per_block == 6
    # soft-caps and scales are compute, not KV: they do not split groups
    capped = AttentionSpec(4, 2, 16, torch.float32, 16, logits_soft_cap=30.0)
    assert group_layers([_spec(), capped]).num_groups == 1
    # another head size or KV heads (Gemma 4's full layers): groups of their own shape, on tensors of their own
    shapes = group_layers([_spec(), _spec(8, head_size=32), _spec(8, head_size=32), _spec(kv_heads=1)])
    assert [g.layers for g in shapes.groups] == [(0,), (3,), (1,), (2,)] and shapes.num_tensors == 3
    assert [shapes.tensor_of(i) for i in range(4)] == [0, 2, 2, 1]
    # a layer reading an earlier layer's cache (Gemma 4's shared KV) joins no group and takes its tensor
    reader = AttentionSpec(4, 2, 16, torch.float32, 16, sliding_window=32, kv_source=1)
    shared = group_layers([_spec(), _spec(32), reader])
    assert shared.readers == ((2, 1),) and [g.layers for g in shared.groups] == [(0,), (1,)]
    assert shared.group_of(2) == shared.group_of(1) and shared.tensor_of(2) == shared.tensor_of(1)
    assert shared.describe().endswith("; 1 layer reading another layer's cache, keeping none")
    with pytest.raises(ConfigError, match="whose spec differs"):  # a full layer reading a window layer's
        group_layers([_spec(32), AttentionSpec(4, 2, 16, torch.float32, 16, kv_source=0)])
    with pytest.raises(ConfigError, match="not an earlier layer"):
        group_layers([AttentionSpec(4, 2, 16, torch.float32, 16, kv_source=1), _spec()])


def test_latent_layers_keep_one_row_and_group_apart():
    """MLA's latent layers (one cached row per token, V its prefix) are a spec of their own: half the page
    of K and V rows of the same width, never in a group with them."""
    from pagellm.core.kv_cache_spec import KVCacheSpec

    latent = AttentionSpec(4, 1, 40, torch.float32, 16, v_head_size=32, latent_kv=True)
    plain = AttentionSpec(4, 1, 40, torch.float32, 16)
    assert KVCacheSpec.of(latent).rows == 1 and KVCacheSpec.of(plain).rows == 2
    assert KVCacheSpec.of(latent).page_bytes == 16 * 40 * 4 == KVCacheSpec.of(plain).page_bytes // 2
    assert group_layers([latent] * 3).groups[0].spec == KVCacheSpec.of(latent)
    with pytest.raises(ConfigError, match="different sizes"):
        group_layers([latent, plain])


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    path = make_tiny_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("qwen3-3to1"),
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=32,
        layer_types=THREE_TO_ONE,
    )
    return path, Reference(path, MAX_TOKENS)


def test_the_start_up_explanation_says_the_groups(mixed_model):
    path, _ = mixed_model
    setup = resolve_engine(EngineConfig(model=str(path), dtype="float32", attention_backend="TORCH_SDPA"))
    assert setup.kv_layout.windows == (None, 32, 32, 32)
    assert "KV cache: 4 groups of 1 layer: full (1 layer), sliding window 32 (3 layers)" in setup.explanation


@pytest.mark.parametrize("backend", ["CPU_ATTN", pytest.param("TORCH_SDPA", marks=pytest.mark.slow)])
def test_a_three_to_one_model_frees_window_blocks_and_matches_transformers(mixed_model, backend):
    """Each layer reads and writes its own group's blocks: a window group's slots never land in a freed
    block (0 in its table), its tables do get freed blocks, and the greedy tokens are transformers'."""
    path, reference = mixed_model
    llm = LLM(
        str(path),
        dtype="float32",
        attention_backend=backend,
        max_model_len=400,
        num_kv_blocks=100,  # 99 one-layer blocks: the prompts below preempt
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    runner, kv = llm.engine.runner, llm.engine.scheduler.kv_cache_manager
    assert kv.windows == (None, 32, 32, 32) and len({t.data_ptr() for t in runner.kv_caches}) == 1
    seen = {"freed": 0, "steps": 0}
    forward = runner._forward

    def checked(step, lora=None, images=None):
        for g, (tables, slots) in enumerate(step.kv_groups()):
            assert (slots // kv.block_size != 0).all(), f"group {g} writes the null block"
            seen["freed"] += int(g > 0 and (tables == 0).any())
        assert not (step.block_tables == 0).any()  # the full group keeps every block
        seen["steps"] += 1
        return forward(step, lora, images)

    runner._forward = checked
    prompts = mixed_prompts(300, seed=3, shared_prefix=40)
    assert_greedy_parity(llm, reference, prompts[:1])
    assert_greedy_parity(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert seen["freed"] > 0 and stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_a_long_decode_holds_a_window_not_the_context(mixed_model):
    path, reference = mixed_model
    llm = LLM(str(path), dtype="float32", max_model_len=400, num_kv_blocks=200, max_num_seqs=2)
    kv, engine = llm.engine.scheduler.kv_cache_manager, llm.engine
    prompt = mixed_prompts(300, seed=4)[14]  # 256 tokens
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    [rid] = engine.output_processor.child_ids(engine.add_request({"prompt_token_ids": prompt}, params))
    held = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if kv.has_blocks(rid):
            held.append((len(kv.block_table(rid)), kv.num_held_blocks(rid)))
    theirs = reference.generate(prompt)
    assert outputs[0].outputs[0].token_ids[: len(theirs)] == theirs
    tables, blocks = held[-1]
    assert tables == -(-(256 + 63) // 16) == 20  # the full group: every block
    assert blocks <= 20 + 3 * 3  # each window group: at most cdiv(31, 16) + 1 blocks
    assert all(np.diff([b for _, b in held]) <= 4)


def test_a_draft_model_over_a_window_model_keeps_group_0_whole(tmp_path):
    target = make_tiny_checkpoint("mistral", tmp_path, sliding_window=48)
    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=400,
        num_kv_blocks=60,
        speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
    )
    assert llm.engine.runner.kv_windows() == (None,)
    assert llm.engine.scheduler.kv_cache_manager.windows == (None,)
    assert_greedy_parity(llm, Reference(target, MAX_TOKENS), mixed_prompts(300, seed=5)[10:14])


def test_a_kv_connector_with_several_groups_is_refused(mixed_model):
    from pagellm.engine.llm_engine import LLMEngine

    path, _ = mixed_model
    config = EngineConfig(model=str(path), dtype="float32", kv_transfer_config='{"kv_connector": "zmq"}')
    with pytest.raises(ConfigError, match="several groups"):
        LLMEngine(config)
