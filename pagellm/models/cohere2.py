"""Cohere's Command R7B and Command A (`Cohere2ForCausalLM`): Llama's skeleton (GQA, the gated MLP, the
tensor and pipeline parallel split, the head) with Cohere's differences, as transformers' `cohere2` computes
them:

- the parallel block: attention and the MLP both read one LayerNorm of the layer's input, and both outputs
  join the residual stream (no second norm)
- LayerNorm without bias (`layer_norm_eps`), computed in float32 and scaled by the weight there before the
  cast back
- rotary in interleaved pairs (x0, x1), (x2, x3), ... rather than halves, computed in float32
- sliding-window layers with rotary and global layers without it (NoPE), from `layer_types` (older configs'
  `sliding_window_pattern`: every fourth layer global)
- logits multiplied by `logit_scale`; the head tied to the embedding (the config's default)
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import rotate_pairs
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, SpecFn


class Cohere2LayerNorm(RMSNorm):
    """Mean-centred and normalised in float32, times the weight in float32, then cast back; no bias. The
    weight and the residual add are RMSNorm's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class Cohere2Attention(LlamaAttention):
    """Llama's attention with interleaved rotary on the sliding-window layers only: transformers rotates
    where the layer has a window, so the global layers (and every layer of a config without a window)
    attend without positions."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.rotates = self.attn.spec.sliding_window is not None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotates:
            q = rotate_pairs(q.reshape(-1, self.num_heads, self.head_dim), cos, sin, round_cos_sin=True)
            k = rotate_pairs(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin, round_cos_sin=True)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Cohere2DecoderLayer(nn.Module):
    """One LayerNorm feeding attention and the MLP side by side."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = Cohere2LayerNorm(c.hidden_size, c.layer_norm_eps, init.dtype)
        self.self_attn = Cohere2Attention(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.mlp = LlamaMLP(init)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as LlamaModel passes them: the stream is h + residual. Returned as (mlp, x + attn),
        so the next layer adds them in transformers' order, (x + attn) + mlp."""
        x = h if residual is None else h + residual
        normed = self.input_layernorm(x)
        return self.mlp(normed), x + self.self_attn(normed, cos, sin)


class Cohere2Model(LlamaModel):
    layer_class = Cohere2DecoderLayer
    norm_class = Cohere2LayerNorm
    eps_field = "layer_norm_eps"


class Cohere2ForCausalLM(LlamaForCausalLM):
    """Llama's head (tied by default, as transformers' config is), the logits times `logit_scale`."""

    tied_by_default = True
    model_class = Cohere2Model

    def __init__(self, init: ModelInit):
        super().__init__(init)
        self.logit_scale = float(init.hf_config.logit_scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale
