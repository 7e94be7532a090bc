"""GLM-4.5 (`Glm4MoeForCausalLM`) against transformers on tiny checkpoints: logits through prefill and decode
(partial rotary, q/k norms and biases on and off, ungrouped and grouped sigmoid routing), which layers have
experts, bfloat16 with a float32 router, the MTP layer skipped, and a split whose shared experts cannot be
sharded refused. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES); over
2 ranks in tests/distributed/test_moe_parallel.py (-m slow)."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from tiny import make_tiny_checkpoint

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.setup import resolve_engine
from pagellm.models.layers.fused_moe.block import SparseMoeBlock

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
VARIANTS = {
    "glm4_moe": {},  # q/k norms, q/k/v biases, one group
    "glm4_moe-grouped-plain-attention": {
        "num_hidden_layers": 3,
        "use_qk_norm": False,
        "attention_bias": False,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": False,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    path = make_tiny_checkpoint("glm4_moe", tmp_path, **VARIANTS[variant])
    reference = load_reference(path)
    model = load_pagellm(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [isinstance(layer.mlp, Glm4MoeMoE) for layer in reference.model.layers]
    assert sparse[0] is False and all(sparse[1:])
    runner = PagedRunner(model, num_seqs=2)
    ids, other = list(PROMPT), PROMPT[::-1]
    got = runner.step({0: ids, 1: other[:5]})
    torch.testing.assert_close(got[0], reference_logits(reference, ids), atol=ATOL, rtol=0)
    for i in range(4):  # decodes beside the other sequence's prefill chunks
        ids.append(int(got[0][-1].argmax()))
        got = runner.step({0: ids[-1:], 1: other[5 + 2 * i : 7 + 2 * i]})
        torch.testing.assert_close(got[0][-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], reference_logits(reference, other[:13])[11:], atol=ATOL, rtol=0)


def test_mtp_layer_is_skipped(tmp_path):
    """GLM-4.5 checkpoints hold their multi-token-prediction layer as layer num_hidden_layers: its tensors
    load into nothing and change nothing."""
    from safetensors.torch import save_file

    path = make_tiny_checkpoint("glm4_moe", tmp_path)
    before = PagedRunner(load_pagellm(path), 1).step({0: PROMPT})[0]
    mtp = {
        "model.layers.2.eh_proj.weight": torch.randn(64, 128),
        "model.layers.2.enorm.weight": torch.randn(64),
        "model.layers.2.self_attn.q_proj.weight": torch.randn(128, 64),
        "model.layers.2.mlp.experts.0.gate_proj.weight": torch.randn(32, 64),
        "model.layers.2.mlp.gate.e_score_correction_bias": torch.randn(8),
        "model.layers.2.shared_head.head.weight": torch.randn(384, 64),
    }
    save_file(mtp, path / "model-mtp.safetensors")
    after = PagedRunner(load_pagellm(path), 1).step({0: PROMPT})[0]
    assert torch.equal(before, after)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
def test_shared_experts_that_cannot_be_sharded_are_refused(tmp_path, expert_parallel):
    """The shared experts are one MLP of n_shared_experts x moe_intermediate_size, sharded by width even
    when the routed experts are split whole."""
    path = make_tiny_checkpoint("glm4_moe", tmp_path, n_shared_experts=3, moe_intermediate_size=33)
    config = EngineConfig(model=str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    message = "shared experts' width .* 99 does not divide" if expert_parallel else "moe_intermediate_size 33"
    with pytest.raises(ConfigError, match=message):
        resolve_engine(config)


def test_bfloat16_model_keeps_a_float32_router_and_stays_close_to_transformers(tmp_path):
    """transformers keeps the router's weight and correction bias in float32 (`_keep_in_fp32_modules`)."""
    path = make_tiny_checkpoint("glm4_moe", tmp_path)
    model = load_pagellm(path, torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    got = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert got.dtype == torch.bfloat16
    reference = reference_logits(load_reference(path, torch.bfloat16), PROMPT)
    torch.testing.assert_close(got.float(), reference, atol=0.15, rtol=0)
