"""OLMo 2 (`Olmo2ForCausalLM`): the Llama decoder with its norms after the blocks rather than before them
(each block's output is normalised before it joins the residual stream; no input norms), and RMSNorm over
the whole q and k projections (all heads together, before they are split into heads and rotated). Its
norms scale by the weight in float32 before casting back (transformers' Olmo2RMSNorm).

Tensor parallelism: a rank holds some heads of q and k, so the q/k norms add up their squares over the
ranks (one all-reduce of a column each) before dividing by the whole projection's width.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed import Group
from pagellm.models.base import ModelInit
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import apply_rotary
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, SpecFn


class Olmo2RMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class ProjectionRMSNorm(nn.Module):
    """Olmo2RMSNorm over a whole projection of which this tensor-parallel rank holds the features
    `part` = (start, length). A KV head replicated on several ranks is counted once per rank holding it,
    which the divisor (ranks x length) accounts for: every rank holds the same number of features."""

    def __init__(self, part: tuple[int, int], eps: float, dtype: torch.dtype, tp: Group):
        super().__init__()
        self.part, self.eps, self.tp = part, eps, tp
        self.weight = nn.Parameter(torch.ones(part[1], dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.size == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (self.tp.size * self.part[1])
        return (self.weight * (h * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def narrow_checkpoint(self, attr: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's features of the checkpoint's weight (called by the loader)."""
        return tensor.narrow(0, *self.part) if self.tp.size > 1 else tensor


class Olmo2Attention(LlamaAttention):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, False, spec_fn)
        c, tp = init.hf_config, init.parallel.tp
        kv_head = (
            tp.rank * c.num_key_value_heads // tp.size
        )  # this rank's first KV head, as in LlamaAttention
        eps, dtype = c.rms_norm_eps, init.dtype
        self.q_norm = ProjectionRMSNorm((tp.rank * self.q_size, self.q_size), eps, dtype, tp)
        self.k_norm = ProjectionRMSNorm((kv_head * self.head_dim, self.kv_size), eps, dtype, tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """cos/sin None: no rotary (OLMo Hybrid's NoPE attention)."""
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(-1, self.num_kv_heads, self.head_dim)
        if cos is not None:
            # in float32, cast back after: transformers' OLMo 2/3 keep cos/sin float32, which promotes q and k
            q = apply_rotary(q.float(), cos, sin).to(q.dtype)
            k = apply_rotary(k.float(), cos, sin).to(k.dtype)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Olmo2DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Olmo2Attention
    norm_class: type[nn.Module] = Olmo2RMSNorm
    """The two norms' class (EXAONE 4 scales by the weight after the cast back, as Llama does)."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        self.self_attn = self.attention_class(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.mlp = LlamaMLP(init)
        self.post_attention_layernorm = self.norm_class(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.post_feedforward_layernorm = self.norm_class(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as LlamaModel passes them: the stream is h + residual."""
        x = h if residual is None else h + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
