"""`select_experts` against the routers transformers runs for each family: the same experts with the same
weights for random logits (the ids compared as sets per token, since some routers return them unsorted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.models.layers.fused_moe.routing import (
    SIGMOID,
    SOFTMAX,
    SOFTMAX_AFTER_TOPK,
    Routing,
    select_experts,
)

HIDDEN, TOKENS = 32, 40


def _config(name: str, **fields):
    import transformers

    return getattr(transformers, name)(hidden_size=HIDDEN, **fields)


def _routers():
    """(transformers router module, our Routing, whether it has a correction bias) per family variant."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    grouped = dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    return {
        "mixtral": (
            MixtralTopKRouter(_config("MixtralConfig", num_local_experts=8, num_experts_per_tok=2)),
            Routing(2, SOFTMAX, renormalize=True),
        ),
        "qwen3_moe-norm_topk_prob": (
            Qwen3MoeTopKRouter(
                _config("Qwen3MoeConfig", num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
            ),
            Routing(3, SOFTMAX, renormalize=True),
        ),
        "qwen2_moe": (
            Qwen2MoeTopKRouter(
                _config("Qwen2MoeConfig", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
            ),
            Routing(2, SOFTMAX),
        ),
        "deepseek_v3-noaux_tc": (
            DeepseekV3TopkRouter(_config("DeepseekV3Config", **grouped)),
            Routing(4, SIGMOID, True, 4, 2, 2.5, renormalize_eps=1e-20),
        ),
        "glm4_moe": (
            Glm4MoeTopkRouter(_config("Glm4MoeConfig", **grouped, norm_topk_prob=False)),
            Routing(4, SIGMOID, False, 4, 2, 2.5),
        ),
        "deepseek_v2-group_limited_greedy": (
            DeepseekV2TopkRouter(_config("DeepseekV2Config", **grouped, topk_method="group_limited_greedy")),
            Routing(4, SOFTMAX, False, 4, 2, 2.5),
        ),
        "deepseek_v2-greedy": (
            DeepseekV2TopkRouter(_config("DeepseekV2Config", **grouped, topk_method="greedy")),
            Routing(4, SOFTMAX, scaling_factor=2.5),
        ),
        "gpt_oss": (
            GptOssTopKRouter(_config("GptOssConfig", num_local_experts=8, num_experts_per_tok=3)),
            Routing(3, SOFTMAX_AFTER_TOPK),
        ),
    }


@pytest.mark.parametrize("family", list(_routers()))
def test_routing_matches_transformers(family):
    router, routing = _routers()[family]
    _assert_routes_like(router, routing)


def _assert_routes_like(router, routing: Routing, their_weights_fn=None) -> None:
    """`select_experts` with `routing` on random weights and hidden states gives the experts and weights of
    transformers' `router` (its weights passed through `their_weights_fn` first, where given)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in [*router.named_parameters(), *router.named_buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * (0.5 if "bias" in name else 1.0))
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    with torch.no_grad():
        _, their_weights, their_ids = router(hidden)
    if their_weights_fn is not None:
        their_weights = their_weights_fn(their_weights)
    bias = getattr(router, "bias", None)
    logits = F.linear(hidden, router.weight, bias if isinstance(bias, torch.Tensor) else None)
    correction = getattr(router, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, routing, correction)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == their_ids.shape
    ours, theirs = ids.sort(dim=-1), their_ids.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(
        weights.gather(1, ours.indices), their_weights.float().gather(1, theirs.indices), rtol=1e-6, atol=1e-6
    )
    if routing.num_groups > 1:  # the groups really limited the choice: some token's best expert was left out
        scores = logits.softmax(-1) if routing.scoring == SOFTMAX else logits.sigmoid()
        assert (scores.topk(routing.top_k).indices.sort().values != ours.values).any()


DEEPSEEK_CONFIGS = {
    "deepseek_v2-greedy": ("DeepseekV2Config", {"topk_method": "greedy"}),
    "deepseek_v2-group_limited_greedy": ("DeepseekV2Config", {"topk_method": "group_limited_greedy"}),
    "deepseek_v3": ("DeepseekV3Config", {}),
    "deepseek_v3-unnormalised": ("DeepseekV3Config", {"norm_topk_prob": False}),
    "glm4_moe": ("Glm4MoeConfig", {}),
}


@pytest.mark.parametrize("family", list(DEEPSEEK_CONFIGS))
def test_deepseek_routing_reads_the_config_as_transformers(family):
    """`deepseek_routing` (DeepSeek-V2/V3, GLM-4.5) from a config, against that config's transformers router."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from pagellm.models.deepseek import deepseek_routing

    name, fields = DEEPSEEK_CONFIGS[family]
    config = _config(
        name,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        **fields,
    )
    router = {"DeepseekV2Config": DeepseekV2TopkRouter, "DeepseekV3Config": DeepseekV3TopkRouter}.get(
        name, Glm4MoeTopkRouter
    )(config)
    _assert_routes_like(router, deepseek_routing(config))


def test_deepseek_v2_renormalises_with_norm_topk_prob_as_deepseeks_own_code():
    """transformers' V2 router ignores norm_topk_prob; DeepSeek's code divides the k weights by their sum
    (+1e-20), then scales them by routed_scaling_factor."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from pagellm.models.deepseek import deepseek_routing

    config = _config(
        "DeepseekV2Config",
        n_routed_experts=8,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    routing = deepseek_routing(config)
    assert routing.renormalize

    def renormalised(weights):
        unscaled = weights / 2.5
        return unscaled / (unscaled.sum(-1, keepdim=True) + 1e-20) * 2.5

    _assert_routes_like(DeepseekV2TopkRouter(config), routing, renormalised)


def test_unknown_scoring_is_refused():
    with pytest.raises(ValueError, match="unknown routing scoring"):
        Routing(2, "relu")
