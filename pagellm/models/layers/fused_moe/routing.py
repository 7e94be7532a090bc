"""Which experts each token goes to, and with what weight: the router's logits [T, E] in, the step's
`topk_weights` [T, K] float32 and `topk_ids` [T, K] int64 out (the contract of `pagellm.core.moe`).

Routing is kept apart from the expert compute so that every family's scoring (softmax or sigmoid, grouped,
biased, rescaled) runs before the same kernels. Each variant follows the transformers routers step for
step (tests/models/test_moe_routing.py compares them), including where they compute in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SOFTMAX = "softmax"
"""softmax over all experts, then the top k (Mixtral, Qwen2/3-MoE, DeepSeek-V2)."""
SIGMOID = "sigmoid"
"""sigmoid per expert; the choice adds `e_score_correction_bias`, the weights do not (DeepSeek-V3, GLM-4.5)."""
SOFTMAX_AFTER_TOPK = "softmax_after_topk"
"""the top k of the logits (router bias included), softmax over those k only (GPT-OSS)."""
SCORINGS = (SOFTMAX, SIGMOID, SOFTMAX_AFTER_TOPK)


@dataclass(frozen=True)
class Routing:
    """How a family's router picks experts; each family builds it from its Hugging Face config.

    Grouped top-k (`num_groups` > 1): the experts are split into `num_groups` equal groups, each group
    scored (with a correction bias: the sum of its two best scores, DeepSeek-V3's "noaux_tc"; without:
    its best score, DeepSeek-V2's "group_limited_greedy"; `group_top2` says otherwise), and only the
    `topk_groups` best groups' experts are candidates."""

    top_k: int
    scoring: str = SOFTMAX
    renormalize: bool = False
    """Divide the k weights by their sum (Mixtral always, Qwen with `norm_topk_prob`)."""
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0
    """`routed_scaling_factor`: multiplies the final weights (DeepSeek)."""
    renormalize_eps: float = 0.0
    """Added to the sum before renormalising (DeepSeek-V3 and GLM-4.5: 1e-20)."""
    group_top2: bool | None = None
    """How a group is scored: the sum of its two best scores (True), its best one (False); None: the sum
    where a correction bias is given, else the best (DeepSeek-V3 / V2). Mistral 4: softmax without a bias,
    the two best."""

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown routing scoring {self.scoring!r}; known: {', '.join(SCORINGS)}")


def select_experts(
    router_logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, K] float32, topk_ids [T, K] int64) for the router's logits [T, E].

    `correction_bias` [E]: DeepSeek-V3's `e_score_correction_bias`, added to the scores only to choose."""
    logits = router_logits.float() if routing.scoring != SOFTMAX_AFTER_TOPK else router_logits
    if routing.scoring == SOFTMAX_AFTER_TOPK:
        values, ids = torch.topk(logits, routing.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=values.dtype).float()
    else:
        scores = logits.softmax(dim=-1) if routing.scoring == SOFTMAX else logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if routing.num_groups > 1:
            top2 = routing.group_top2 if routing.group_top2 is not None else correction_bias is not None
            choice = _mask_to_best_groups(choice, routing, top2)
        ids = torch.topk(choice, routing.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + routing.renormalize_eps)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, ids.to(torch.int64)


def _mask_to_best_groups(choice: torch.Tensor, routing: Routing, top2_sum: bool) -> torch.Tensor:
    """`choice` with -inf outside each token's `topk_groups` best groups."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, routing.num_groups, num_experts // routing.num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if top2_sum else grouped.max(dim=-1).values
    best = torch.topk(group_scores, routing.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
