"""The routed experts of a mixture-of-experts model as the floor (pagellm.bench.floor) counts them, and the
MLP part of a model's linears as a Hugging Face config gives it (dense layers, routers, shared experts).

FLOPs: every token runs its top K of a layer's E experts, 2 * K * (one expert's weights) per MoE layer.

Bytes: a step reads each expert its tokens chose once, so experts are charged per step by the step's token
count, not with the weights every step reads whole. The floor does not see the router's choices, so it
takes the expected number of distinct experts that n tokens choose when each picks K of the E uniformly:
a given expert escapes one token with probability 1 - K/E, so E * (1 - (1 - K/E)^n) per layer. One decode
token reads K experts; 64 tokens of a 128-expert, top-8 model read 126 of them. Real routers favour some
experts, so a step can read fewer than this expectation says.

Shared experts (DeepSeek, GLM-4.5, Qwen2-MoE) and routers run for every token: they are plain linears,
counted with the rest of the decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagellm.models.deepseek import deepseek_sparse_layer
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, expert_count, is_sparse_layer

MOE_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "mixtral",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "glm_moe_dsa",
)
"""Mixture-of-experts configs `mlp_from_hf_config` knows."""
FLOAT32_ROUTERS = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa")
"""Families whose router weights are float32 whatever the model's dtype (`deepseek_moe_block`)."""


@dataclass(frozen=True)
class Experts:
    """One rank's routed experts: `local_experts` of the model's `num_experts` per MoE layer (all of them,
    unless expert parallelism splits them), each `params` weights and biases (3 * H * I, plus 2I + H with
    biases, at this rank's width I) taking `bytes` as stored."""

    layers: int
    num_experts: int
    top_k: int
    params: int
    bytes: int
    local_experts: int

    def flops_per_token(self) -> float:
        """2 * K * params per MoE layer, for the share of a token's K experts this rank holds."""
        return 2.0 * self.top_k * self.params * self.layers * self.local_experts / self.num_experts

    def distinct(self, num_tokens: int) -> float:
        """Expected distinct experts of this rank that `num_tokens` tokens choose in one layer, each token
        K of the E uniformly: local_experts * (1 - (1 - K/E)^n)."""
        if num_tokens <= 0:
            return 0.0
        return self.local_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def step_bytes(self, num_tokens: int) -> float:
        """Expert bytes a step of `num_tokens` tokens reads over all MoE layers (expected, uniform routing)."""
        return self.layers * self.distinct(num_tokens) * self.bytes


def mlp_from_hf_config(hf_config: Any, dtype: torch.dtype) -> tuple[int, int, Experts | None]:
    """(params, bytes, experts) of a Llama-style config's MLPs over all layers: dense gated MLPs
    (3 * hidden * intermediate_size), and on MoE layers the router (hidden * E), the shared experts and
    the routed experts apart. Biases are left out but for the experts'. Raises ValueError for a
    mixture-of-experts config whose layout it does not know."""
    c = hf_config
    kind = getattr(c, "model_type", "")
    hidden, layers = c.hidden_size, c.num_hidden_layers
    elem = element_size(dtype)
    num_experts = expert_count(c)
    if not num_experts:
        params = layers * 3 * hidden * c.intermediate_size
        return params, params * elem, None
    if kind not in MOE_FAMILIES:
        raise ValueError(f"no floor model for the experts of {kind!r}; known: {', '.join(MOE_FAMILIES)}")
    sparse = deepseek_sparse_layer if kind.startswith("deepseek") else is_sparse_layer
    moe_layers = sum(1 for i in range(layers) if sparse(c, i))
    width = c.intermediate_size if kind in ("mixtral", "gpt_oss") else c.moe_intermediate_size
    if kind in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        shared = 3 * hidden * c.shared_expert_intermediate_size + hidden  # and its gate, hidden -> 1
    else:
        shared = 3 * hidden * (getattr(c, "n_shared_experts", None) or 0) * width
    router = hidden * num_experts
    dense = (layers - moe_layers) * 3 * hidden * c.intermediate_size
    params = dense + moe_layers * (shared + router)
    router_elem = 4 if kind in FLOAT32_ROUTERS else elem
    nbytes = (dense + moe_layers * shared) * elem + moe_layers * router * router_elem
    expert = 3 * hidden * width + (2 * width + hidden if kind == "gpt_oss" else 0)
    experts = Experts(moe_layers, num_experts, c.num_experts_per_tok, expert, expert * elem, num_experts)
    return params, nbytes, experts


def experts_of_model(model: torch.nn.Module) -> Experts | None:
    """The experts of a loaded model's `SparseMoeBlock`s (None without any), from the layers' shapes and
    dtype (or a GGUF file's blocks, as the layer keeps them): the same whether the platform's kernel holds
    them (its packed copy may pad) or the layer does.
    Layers may differ in their experts' bytes (a Q4_K_M keeps some layers' down projections in more bits):
    `bytes` is then the mean over layers, which is what a step reads per expert on average.
    Raises ValueError if the MoE layers differ in shape."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    facts = [_block_experts(b) for b in blocks]
    shapes = {(e, k, params, local) for e, k, params, _, local in facts}
    if len(shapes) > 1:
        raise ValueError(f"the model's MoE layers differ in shape: {sorted(shapes, key=str)}")
    if not shapes:
        return None
    num_experts, top_k, params, local = shapes.pop()
    nbytes = round(sum(f[3] for f in facts) / len(facts))
    return Experts(len(blocks), num_experts, top_k, params, nbytes, local)


def _block_experts(block: Any) -> tuple[int, int, int, int, int]:
    layer = block.experts
    width, hidden = layer.width, layer.hidden_size
    params = 3 * hidden * width + (2 * width + hidden if layer.has_bias else 0)
    return (
        block.gate.out_features,
        block.gate.routing.top_k,
        params,
        layer.expert_block_bytes or params * element_size(layer.weight_dtype),
        layer.num_local_experts,
    )


def element_size(dtype: torch.dtype) -> int:
    """Bytes of one element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()
