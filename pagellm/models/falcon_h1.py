"""TII Falcon-H1 (`FalconH1ForCausalLM`: Falcon-H1-0.5B .. 34B, -Deep, -Tiny): attention and a Mamba-2 layer
side by side in every layer, both reading the same normed input, their outputs summed into the residual,
then a SwiGLU MLP.

The Mamba-2 layer is models/layers/mamba2.py's (its conv window and SSM state per sequence in the state
cache), with Falcon-H1's own around the scan: `mamba_d_ssm` as its inner width, the input times
`ssm_in_multiplier`, the projection times the muP vector (`ssm_multipliers`: one factor each for z, x, B, C
and dt, transformers' `compute_mup_vector`), an optional gated RMSNorm (`mamba_rms_norm`; the norm before or
after the gate by `mamba_norm_before_gate`, else y * silu(z)) and its own out_proj bias (`projectors_bias`).
The other multipliers scale, as transformers does: the embeddings (`embedding_multiplier`), the attention's
input and output (`attention_in_multiplier`, `attention_out_multiplier`), its keys (`key_multiplier`, before
the rotary), the Mamba output (`ssm_out_multiplier`), the MLP's gate before its activation and its output
(`mlp_multipliers`) and the logits (`lm_head_multiplier`). Each multiplies the activations rather than being
folded into a weight, so a LoRA adapter on q/k/v/o or gate/up/down is scaled as in transformers.

Every layer holds both a KV cache (attention layer i) and a recurrent state (state i).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer, Mamba2Shape
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.llama import STACKED, LlamaAttention, LlamaMLP, attention_spec
from pagellm.models.loader import copy_weights


def mup_vector(c: Any) -> torch.Tensor:
    """The factor of each in_proj output (transformers' `compute_mup_vector`): z, x, B, C and dt times the
    five `ssm_multipliers`."""
    inner, groups_state = (
        c.mamba_d_ssm or int(c.mamba_expand * c.hidden_size),
        c.mamba_n_groups * c.mamba_d_state,
    )
    widths = (inner, inner, groups_state, groups_state, c.mamba_n_heads)
    return torch.cat([torch.full((w,), float(m)) for w, m in zip(widths, c.ssm_multipliers, strict=True)])


class NormThenGate(GroupedGatedRMSNorm):
    """norm(y) * silu(z), each group of the width normed apart (transformers' FalconH1RMSNormGated with
    norm_before_gate=True), in float32."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float().unflatten(-1, (self.groups, -1))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (self.weight * h * F.silu(gate.float())).to(y.dtype)


class Gate(nn.Module):
    """y * silu(z) with no norm (`mamba_rms_norm` False)."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return y * F.silu(gate)


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2Mixer with Falcon-H1's input multipliers, norm choice and out_proj bias."""

    def __init__(self, init: ModelInit, state_idx: int):
        c = init.hf_config
        super().__init__(init, state_idx, Mamba2Shape.from_mamba_fields(c))
        if not c.mamba_rms_norm:
            self.norm = Gate()
        elif c.mamba_norm_before_gate:
            self.norm = NormThenGate(self.intermediate_size, self.n_groups, c.rms_norm_eps, init.dtype)
        self.out_proj = Linear(self.intermediate_size, c.hidden_size, c.projectors_bias, init.dtype)
        self.ssm_in_multiplier = float(c.ssm_in_multiplier)
        self.register_buffer("mup_vector", mup_vector(c).to(init.dtype), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        projected = self.in_proj(h * self.ssm_in_multiplier) * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        return self.out_proj(self.norm(self.scan(xbc, dt), gate))


class Scale(nn.Module):
    """x times a constant: the keys' `key_multiplier`, in LlamaAttention's place for a k norm (after the
    projection, before the rotary, as transformers applies it)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class FalconH1Attention(LlamaAttention):
    def __init__(self, init: ModelInit, layer_idx: int):
        c = init.hf_config
        super().__init__(init, layer_idx, c.attention_bias, False, attention_spec)
        self.q_norm, self.k_norm = nn.Identity(), Scale(float(c.key_multiplier))


class FalconH1MLP(LlamaMLP):
    """SwiGLU with the gate times `mlp_multipliers[0]` before its activation and the output times
    `mlp_multipliers[1]`."""

    def __init__(self, init: ModelInit):
        super().__init__(init)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in init.hf_config.mlp_multipliers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(up * self.act.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mamba = FalconH1Mixer(init, layer_idx)
        self.self_attn = FalconH1Attention(init, layer_idx)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.feed_forward = FalconH1MLP(init)
        self.attention_in_multiplier = float(c.attention_in_multiplier)
        self.attention_out_multiplier = float(c.attention_out_multiplier)
        self.ssm_out_multiplier = float(c.ssm_out_multiplier)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        mamba = self.mamba(x) * self.ssm_out_multiplier
        attention = self.self_attn(x * self.attention_in_multiplier, cos, sin) * self.attention_out_multiplier
        h = h + (mamba + attention)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1Model(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        self.embedding_multiplier = float(c.embedding_multiplier)
        self.rotary_emb = RotaryEmbedding(c)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(init, i) for i in range(c.num_hidden_layers))
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)
        h = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.final_layernorm(h)


class FalconH1ForCausalLM(CausalLM):
    unsplit_layers = "the Mamba-2 mixers (models/layers/mamba2.py) have no split of their heads or state"
    attention_spec = staticmethod(attention_spec)

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.model = FalconH1Model(init)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )
        self.lm_head_multiplier = float(c.lm_head_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight) * self.lm_head_multiplier

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(
            self, ((n, t) for n, t in weights if not (self.tied and n == "lm_head.weight")), STACKED
        )
