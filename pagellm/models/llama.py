"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral, SmolLM2, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm). One decoder, parametrised by the config and two class-level switches.

q/k/v and gate/up are fused into one matmul each; checkpoint tensors are loaded into their slices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import CausalLM, ModelInit, head_size
from pagellm.models.layers.activation import GatedActivation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.models.loader import copy_weights

STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def layer_sliding_window(hf_config, layer_idx: int) -> int | None:
    """Mistral: `sliding_window` for every layer; Qwen2/3: only layers whose `layer_types` say so."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None)


def attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
        sliding_window=layer_sliding_window(hf_config, layer_idx),
    )


class LlamaAttention(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        spec = attention_spec(c, init.dtype, init.block_size, layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(c.hidden_size, sum(sizes), qkv_bias, init.dtype, init.quant_method, sizes)
        o_bias = getattr(c, "attention_bias", False)
        self.o_proj = Linear(self.q_size, c.hidden_size, o_bias, init.dtype, init.quant_method)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
        self.attn = Attention(init, spec, layer_idx)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        bias = getattr(c, "mlp_bias", False)
        size = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * size, bias, init.dtype, init.quant_method, [size, size])
        self.act = GatedActivation(c.hidden_act)
        self.down_proj = Linear(size, c.hidden_size, bias, init.dtype, init.quant_method)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.self_attn = LlamaAttention(init, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mlp = LlamaMLP(init)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype)
        self.rotary_emb = RotaryEmbedding(c)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(init, i, qkv_bias, qk_norm) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        return self.norm.add_and_norm(h, residual)[0]


class LlamaForCausalLM(CausalLM):
    qkv_bias: bool | None = None
    """Bias on q/k/v projections; None: the config's `attention_bias`."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before rotary (Qwen3)."""
    attention_spec = staticmethod(attention_spec)

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else getattr(c, "attention_bias", False)
        self.model = LlamaModel(init, qkv_bias, self.qk_norm)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, False, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
            return None
        return name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window (from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
