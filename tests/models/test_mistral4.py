"""Mistral 4 against transformers on tiny checkpoints: its router, logits through chunked prefill and decode
(the tiny shape, and plain q_proj with biases, rope in halves, one group, a tied head), its decoder in a
`Mistral3ForConditionalGeneration` checkpoint, and tensor, pipeline and expert parallelism under -m slow
(a config without the query scale's parameters is refused in test_ministral3.py, as Ministral 3's). Greedy parity through the engine (chunked prefill,
prefix hits, preemption) is in tests/engine/test_family_parity.py (FAMILIES["mistral4"])."""

from __future__ import annotations

import pytest
import torch
from models_harness import assert_decode_matches, load_pagellm, load_reference
from test_ministral3 import mistral3_checkpoint
from tiny import make_tiny_checkpoint, tiny_config

from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.routing import select_experts
from pagellm.models.mistral4 import mistral4_routing

ATOL = 1e-4
VARIANTS = {
    "tiny": {},
    "plain-q-biases-halves-one-group-tied": dict(
        q_lora_rank=None,
        attention_bias=True,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        tie_word_embeddings=True,
    ),
}


def dense(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] with each token's weights at its chosen experts (the order of the k does not matter)."""
    return torch.zeros(ids.shape[0], num_experts).scatter_(1, ids.long(), weights.float())


@pytest.mark.parametrize(
    "fields",
    [
        dict(n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(n_group=8, topk_group=3, num_experts_per_tok=4, norm_topk_prob=True, routed_scaling_factor=1.0),
    ],
)
def test_the_router_is_transformers(fields):
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    config = tiny_config("mistral4", 384, n_routed_experts=16, **fields)
    router = Mistral4TopkRouter(config)
    torch.manual_seed(0)
    router.weight.data.normal_(0, 1.0)
    hidden = torch.randn(64, config.hidden_size)
    logits, their_weights, their_ids = router(hidden)
    weights, ids = select_experts(logits, mistral4_routing(config))
    torch.testing.assert_close(
        dense(weights, ids, 16), dense(their_weights, their_ids, 16), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    path = make_tiny_checkpoint("mistral4", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    first_sparse = reference.config.first_k_dense_replace
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [
        i >= first_sparse for i in range(reference.config.num_hidden_layers)
    ]
    ids = [int(t) for t in torch.randint(3, 380, (100,), generator=torch.Generator().manual_seed(3))]
    assert_decode_matches(model, reference, ids, atol=ATOL, split=70)


def test_the_decoder_of_a_multimodal_checkpoint(tmp_path):
    """Mistral 4 in `Mistral3ForConditionalGeneration` (top-level head untied): text-only logits."""
    from transformers import AutoModelForImageTextToText

    mistral3_checkpoint("mistral4", tmp_path, tie_word_embeddings=False)
    reference = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reference).__name__ == "Mistral3ForConditionalGeneration"
    model = load_pagellm(tmp_path)
    assert type(model).__name__ == "Mistral4TextOfMultimodal" and not model.tied
    ids = [int(t) for t in torch.randint(3, 380, (80,), generator=torch.Generator().manual_seed(5))]
    assert_decode_matches(model, reference, ids, atol=ATOL, steps=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "settings",
    [
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=2, enable_expert_parallel=True),
        dict(pipeline_parallel_size=2),
    ],
    ids=["tp2", "tp2-ep", "pp2"],
)
def test_parallel_engines_match_transformers(tmp_path, settings):
    """On 2 gloo ranks: heads split (each rank the whole latent cache), experts by width or whole, stages."""
    from parity import assert_two_rank_parity

    assert_two_rank_parity("mistral4", tmp_path, 3, **settings)


@pytest.mark.slow
def test_lora_on_o_proj_equals_peft_merged(tmp_path):
    """An adapter on o_proj (the latent projections are no LoRA targets): greedy tokens equal peft's merged
    model's."""
    from parity import Reference, assert_greedy_parity, mixed_prompts
    from peft_adapters import lora_engine

    base = make_tiny_checkpoint("mistral4", tmp_path)
    engine = lora_engine(base, tmp_path, ["o_proj"], seed=1, num_kv_blocks=400, max_lora_rank=4)
    assert_greedy_parity(engine, Reference(tmp_path / "merged", 12), mixed_prompts(300)[:6])
