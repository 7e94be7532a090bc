"""Qwen3-MoE, Qwen2-MoE and Mixtral against transformers on tiny checkpoints: logits through prefill and
decode (dense layers between sparse ones included), bf16, which layers have experts, and a chat through
`LLM`. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, is_sparse_layer

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-sparse-step-2-unnormalised": (
        "qwen3_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "norm_topk_prob": False},
    ),
    "qwen2_moe-mlp-only-layer": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    reference = load_reference(path)
    model = load_pagellm(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [is_sparse_layer(reference.config, i) for i in range(len(sparse))]
    runner = PagedRunner(model, num_seqs=1)
    ids = list(PROMPT)
    got = runner.step({0: ids})[0]
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)
    for _ in range(4):
        ids.append(int(got[-1].argmax()))
        got = runner.step({0: ids[-1:]})[0]
        torch.testing.assert_close(got[-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)


def test_sparse_layers_follow_transformers():
    """Which decoder layers transformers builds with experts, for every config key that makes some dense."""
    import transformers

    configs = [
        transformers.Qwen2MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
        transformers.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[0, 2]),
        transformers.Qwen3MoeConfig(num_hidden_layers=3, num_experts=0),
        transformers.DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2),
        transformers.MixtralConfig(num_hidden_layers=2),
    ]
    expected = [
        [False, True, False, False, False, True],
        [False, True, False, True],
        [False, False, False],
        [False, False, True, True, True],
        [True, True],
    ]
    for config, layers in zip(configs, expected, strict=True):
        assert [is_sparse_layer(config, i) for i in range(config.num_hidden_layers)] == layers
    # transformers' own choice agrees, for the Qwen2-MoE config above
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeSparseMoeBlock

    small = transformers.Qwen2MoeConfig(
        num_hidden_layers=6,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        hidden_size=16,
        num_experts=2,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=4,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    hf = [isinstance(Qwen2MoeDecoderLayer(small, i).mlp, Qwen2MoeSparseMoeBlock) for i in range(6)]
    assert hf == expected[0]


def test_bfloat16_model_stays_close_to_transformers_bfloat16(tmp_path):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    got = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_logits(reference, PROMPT), atol=0.15, rtol=0)


def test_chat_through_the_engine_matches_transformers(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(out.prompt_token_ids) == expected
    assert list(out.outputs[0].token_ids) == Reference(path, 8).generate(list(out.prompt_token_ids))


@pytest.mark.slow
def test_compiled_forward_matches_transformers(tmp_path):
    """The default outside the test suite: torch.compile'd, the reference experts one opaque op
    (`pagellm::moe_reference`) rather than a graph recompiled for every routing pattern."""
    from parity import assert_greedy_parity, mixed_prompts

    path = make_tiny_checkpoint("qwen3_moe", tmp_path)
    llm = LLM(
        str(path),
        dtype="float32",
        num_kv_blocks=400,
        max_model_len=400,
        enforce_eager=False,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert llm.engine.runner.forward is not llm.engine.runner.model
    assert_greedy_parity(llm, Reference(path, 8), mixed_prompts(300)[:6])
