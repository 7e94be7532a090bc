"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v as in the checkpoint, tied LM head.

Checkpoints store linear weights as Conv1D ([in, out]); loading transposes them to [out, in].
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import CausalLM, ModelInit, head_size
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.loader import copy_weights

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    size = head_size(hf_config)
    scale = size**-0.5 if hf_config.scale_attn_weights else 1.0
    if hf_config.scale_attn_by_inverse_layer_idx:
        scale /= layer_idx + 1
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_attention_heads,
        head_size=size,
        dtype=dtype,
        block_size=block_size,
        scale=scale,
    )


class GPT2Attention(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.hidden_size = c.hidden_size
        self.c_attn = Linear(c.hidden_size, 3 * c.hidden_size, True, init.dtype, init.quant_method)
        self.c_proj = Linear(c.hidden_size, c.hidden_size, True, init.dtype, init.quant_method)
        spec = attention_spec(c, init.dtype, init.block_size, layer_idx)
        self.attn = Attention(init, spec, layer_idx)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(h).split(self.hidden_size, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        inner = c.n_inner or 4 * c.hidden_size
        self.c_fc = Linear(c.hidden_size, inner, True, init.dtype, init.quant_method)
        self.act = get_activation(c.activation_function)
        self.c_proj = Linear(inner, c.hidden_size, True, init.dtype, init.quant_method)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(h)))


class GPT2Block(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.ln_1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_epsilon, dtype=init.dtype)
        self.attn = GPT2Attention(init, layer_idx)
        self.ln_2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_epsilon, dtype=init.dtype)
        self.mlp = GPT2MLP(init)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.wte = Embedding(c.vocab_size, c.hidden_size, init.dtype)
        self.wpe = Embedding(c.max_position_embeddings, c.hidden_size, init.dtype)
        self.h = nn.ModuleList(GPT2Block(init, i) for i in range(c.num_hidden_layers))
        self.ln_f = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_epsilon, dtype=init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            h = block(h)
        return self.ln_f(h)


class GPT2LMHeadModel(CausalLM):
    attention_spec = staticmethod(attention_spec)
    unsplit_layers = "GPT-2's blocks (models/gpt2.py: fused c_attn and c_fc, learned positions) have no split"

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.transformer = GPT2Model(init)
        self.tied = bool(getattr(c, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head = self.transformer.wte
        else:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, False, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, adapt=self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Old checkpoints lack the `transformer.` prefix and carry attention-mask buffers."""
        if name.endswith((".attn.bias", ".attn.masked_bias")) or (self.tied and name == "lm_head.weight"):
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(_CONV1D):
            tensor = tensor.t()
        return name, tensor
