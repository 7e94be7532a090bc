"""OLMoE (`OlmoeForCausalLM`, e.g. OLMoE-1B-7B-0125): Llama's pre-norm decoder with routed experts in
every layer (softmax over `num_experts`, the top `num_experts_per_tok`, renormalised only with
`norm_topk_prob`; no shared expert, no dense layers; the experts are `intermediate_size` wide) and OLMo 2's
q/k RMSNorm over the whole q and k projections, before they are split into heads and rotated.

Two details differ from OLMo 2: the q/k norms scale in the input dtype after the cast back, as Llama's
RMSNorm does (OLMo 2 scales in float32 first), and `clip_qkv` clamps q and k (after their norms) and v.

Tensor parallelism as OLMo 2 (the q/k norms add up their squares over the ranks) and Qwen3-MoE (the
experts by width, or whole with --enable-expert-parallel).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.rotary import apply_rotary
from pagellm.models.llama import STACKED, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, SpecFn
from pagellm.models.olmo2 import Olmo2Attention, ProjectionRMSNorm
from pagellm.models.qwen3_moe import softmax_routing


class OlmoeProjectionNorm(ProjectionRMSNorm):
    """OLMo 2's norm over a whole projection, scaled as transformers' OlmoeRMSNorm scales: the normalised
    values cast back to the input dtype, then times the weight (the same in float32, not in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.size == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (self.tp.size * self.part[1])
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)


class OlmoeAttention(Olmo2Attention):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        c, tp = init.hf_config, init.parallel.tp
        self.q_norm = OlmoeProjectionNorm(self.q_norm.part, c.rms_norm_eps, init.dtype, tp)
        self.k_norm = OlmoeProjectionNorm(self.k_norm.part, c.rms_norm_eps, init.dtype, tp)
        clip = getattr(c, "clip_qkv", None)
        self.clip_qkv = float(clip) if clip is not None else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # after the norms, as transformers clamps
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = apply_rotary(q.reshape(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        """Experts in every layer, as wide as the config's `intermediate_size`."""
        c = init.hf_config
        return SparseMoeBlock(init, softmax_routing(c), c.intermediate_size)


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_class = OlmoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)
