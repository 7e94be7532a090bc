"""GLM-4 dense (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1), as transformers' `glm4` computes
it: Llama's decoder with

- two more norms per layer: each block's output is normalised (`post_self_attn_layernorm`,
  `post_mlp_layernorm`) before it joins the residual stream, besides the usual norms before the blocks
  (`input_layernorm`, and `post_attention_layernorm` before the MLP, Llama's name for it)
- partial rotary in interleaved pairs: the first `partial_rotary_factor` (half) of each head's features
  rotate, pair (x0, x1) by the first frequency, (x2, x3) by the second and so on (GLM's own layout, unlike
  GLM-4.5's `glm4_moe`, which rotates halves as Llama does); the rest pass through
- q/k/v biases (`attention_bias`) and none on o_proj
- gate and up fused in the checkpoint (`mlp.gate_up_proj`, gate's rows first), split at load by Phi-3's
  loader, so a tensor-parallel rank reads only its rows of each.

Interleaved pairs are rotated here by moving each head's rotating features of q and k from pairs to halves
(evens, then odds) and rotating halves: q and k move alike, so every q.k is the one transformers computes
(DeepSeek's MLA does the same); v is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import apply_rotary, pairs_to_halves, rotary_dim
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel, SpecFn
from pagellm.models.phi3 import Phi3ForCausalLM


class Glm4Attention(LlamaAttention):
    o_bias = False

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.rotated = rotary_dim(init.hf_config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = pairs_to_halves(q.reshape(-1, self.num_heads, self.head_dim), self.rotated)
        k = pairs_to_halves(k.reshape(-1, self.num_kv_heads, self.head_dim), self.rotated)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer plus a norm on each block's output before the residual add."""

    attention_class = Glm4Attention

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        c = init.hf_config
        self.post_self_attn_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.post_mlp_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.post_self_attn_layernorm(self.self_attn(h, cos, sin))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.post_mlp_layernorm(self.mlp(h)), residual


class Glm4Model(LlamaModel):
    layer_class: type[nn.Module] = Glm4DecoderLayer


class Glm4ForCausalLM(Phi3ForCausalLM):
    """Phi-3's loader (fused checkpoint tensors split into their parts' rows) for the fused gate_up alone;
    q, k and v are separate in GLM-4's checkpoints."""

    family = "GLM-4"
    model_class = Glm4Model

    def __init__(self, init: ModelInit):
        super().__init__(init)
        size = init.hf_config.intermediate_size
        self.fused_parts = {".gate_up_proj.": (("gate_proj", size), ("up_proj", size))}
