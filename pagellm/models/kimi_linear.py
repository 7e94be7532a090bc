"""Kimi Linear (`KimiLinearForCausalLM`, moonshotai/Kimi-Linear-48B-A3B-Instruct): Kimi delta attention layers
(KDA, a recurrent state per sequence, models/layers/kimi_delta_attention.py) beside DeepSeek's Multi-head
Latent Attention without rotary, and DeepSeek-V3's mixture of experts, as transformers' `kimi_linear`
computes them.

- which layer is which: `layer_types` ("linear_attention": KDA, "full_attention": MLA; three KDA layers to
  one MLA layer as released) and `mlp_layer_types` ("dense" before `first_k_dense_replace`, then "sparse").
- MLA (deepseek.py's weight-absorbed form, its one-latent-row KV cache) with no rope at all (NoPE): the
  shared k_pe features are still part of every key and of the cache, only never rotated; the softmax scale
  is (qk_nope + qk_rope) ** -0.5.
- the experts: V3's sigmoid router with the correction bias over `n_group` groups, `norm_topk_prob`,
  `routed_scaling_factor`, a float32 router, `n_shared_experts` shared experts.
- the checkpoint's names: the mixture of experts and the dense MLPs under `block_sparse_moe` (every layer's,
  as transformers' save_pretrained writes them too), experts per expert (`w1`, `w3`, `w2`); the KDA layers
  under `self_attn`, as the MLA layers (told apart here by `layer_types`), their conv split in
  `q_conv1d`/`k_conv1d`/`v_conv1d`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.deepseek import (
    STACKED,
    MLAAttention,
    adapt_moe_names,
    deepseek_moe_block,
    mla_attention_spec,
)
from pagellm.models.layers.conv_weights import join_conv_parts
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.kimi_delta_attention import KimiDeltaAttention
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.llama import LlamaMLP
from pagellm.models.olmo_hybrid import LINEAR_ATTENTION, LinearHybridForCausalLM


class NoPEMLAAttention(MLAAttention):
    """DeepSeek's latent attention whose rope features are never rotated (Kimi Linear's)."""

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        return x


class KimiLinearDecoderLayer(nn.Module):
    """Llama's pre-norm layer with KDA or MLA, the dense MLP or the experts; the (h, residual) stream."""

    def __init__(self, init: ModelInit, layer_idx: int, kind_idx: int):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.linear = c.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.linear:
            self.linear_attn = KimiDeltaAttention(init, kind_idx)
        else:
            self.self_attn = NoPEMLAAttention(init, kind_idx, mla_attention_spec, interleaved=False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mlp = deepseek_moe_block(init) if c.mlp_layer_types[layer_idx] == "sparse" else LlamaMLP(init)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.linear_attn(h) if self.linear else self.self_attn(h, None, None)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class KimiLinearModel(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        counts: dict[str, int] = {}
        layers = []
        for i, kind in enumerate(c.layer_types):
            layers.append(KimiLinearDecoderLayer(init, i, counts.get(kind, 0)))
            counts[kind] = counts.get(kind, 0) + 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual)
        return self.norm.add_and_norm(h, residual)[0]


class KimiLinearForCausalLM(LinearHybridForCausalLM):
    unsplit_layers = (
        "the KDA layers (models/layers/kimi_delta_attention.py) have no split of their heads or state"
    )
    attention_spec = staticmethod(mla_attention_spec)  # the latent layout, no rope scaling in the scale
    float_modules = ("kv_b_proj",)  # a `LatentUpProjection`: a plain weight, read per head
    model_class = KimiLinearModel
    family, recurrent = "Kimi Linear", "the KDA layers"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = (*KimiDeltaAttention.STACKED, *STACKED)
        return copy_weights_with_experts(self, join_conv_parts(weights), stacked, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if self.tied and name == "lm_head.weight":
            return None
        name = adapt_moe_names(name.replace(".block_sparse_moe.", ".mlp."))
        if name.startswith("model.layers.") and self.model.layers[int(name.split(".")[2])].linear:
            name = name.replace(".self_attn.", ".linear_attn.").replace(".o_proj.", ".out_proj.")
        return name, tensor
