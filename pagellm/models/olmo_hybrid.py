"""OLMo Hybrid (`OlmoHybridForCausalLM`, allenai/Olmo-Hybrid-7B): Gated DeltaNet layers (a recurrent state
per sequence, models/layers/gated_delta_net.py) beside OLMo 3's attention layers, by the config's
`layer_types` (three delta-net layers to one attention layer as released), as transformers' `olmo_hybrid`
computes them.

The attention layers are OLMo 2/3's (olmo2.py): q/k RMSNorm over the whole projections, norms after the
attention and the MLP, no sliding window; rotary only where the config has a `rope_theta` (the released
checkpoints have none: NoPE). The delta-net layers are pre-norm (input and post-attention norms, Llama's
order, OLMo's norm) and differ from Qwen3-Next's in three ways: every projection is separate in the
checkpoint (q, k, v, the output gate g, a, b), the write strength beta is sigmoid(b) doubled when
`linear_allow_neg_eigval` (beta in (0, 2), so the state's eigenvalues may turn negative), and the gated
output norm's epsilon is 1e-5 (fla's default) whatever the config's `rms_norm_eps`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.conv_weights import join_conv_parts
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.gated_delta_net import GatedDeltaNet
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.llama import STACKED, LlamaMLP, attention_spec
from pagellm.models.loader import copy_weights
from pagellm.models.olmo2 import Olmo2DecoderLayer, Olmo2RMSNorm

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
OUTPUT_NORM_EPS = 1e-5
"""The delta nets' gated output norm's epsilon: transformers builds it with fla's default, not the config's."""

DELTA_NET_STACKED = (
    ("linear_attn.in_proj_qkvz", "linear_attn.q_proj", 0),
    ("linear_attn.in_proj_qkvz", "linear_attn.k_proj", 1),
    ("linear_attn.in_proj_qkvz", "linear_attn.v_proj", 2),
    ("linear_attn.in_proj_qkvz", "linear_attn.g_proj", 3),
    ("linear_attn.in_proj_ba", "linear_attn.b_proj", 0),
    ("linear_attn.in_proj_ba", "linear_attn.a_proj", 1),
)
"""The delta nets' separate checkpoint projections as parts of `GatedDeltaNet`'s two fused linears; matched
before Llama's `STACKED`, whose q/k/v names they share."""

RENAMED = {
    # transformers' conversion of the released (OLMo-core) names, which its save_pretrained writes back
    "attention_layer_norm": "input_layernorm",
    "feedforward_layer_norm": "post_attention_layernorm",
    # the delta nets' output projection and norm under `GatedDeltaNet`'s names
    "linear_attn.o_proj.": "linear_attn.out_proj.",
    "linear_attn.o_norm.": "linear_attn.norm.",
}


def uses_rope(hf_config: Any) -> bool:
    """Whether the attention layers rotate: as transformers' OlmoHybridModel, only with a `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """`GatedDeltaNet` in Qwen3.5's plain layout, its fused in_proj_qkvz loaded from four checkpoint
    tensors (q, k, v, g: the same rows Qwen3.5 loads from two), beta doubled with negative eigenvalues."""

    def __init__(self, init: ModelInit, state_idx: int):
        c = init.hf_config
        beta_scale = 2.0 if getattr(c, "linear_allow_neg_eigval", True) else 1.0
        super().__init__(init, state_idx, grouped=False, beta_scale=beta_scale, norm_eps=OUTPUT_NORM_EPS)
        self.in_proj_qkvz.output_sizes = [self.key_dim, self.key_dim, self.value_dim, self.value_dim]


class OlmoHybridDeltaNetLayer(nn.Module):
    """A delta-net layer: pre-norm, the (h, residual) stream of `Olmo2DecoderLayer` (h + residual)."""

    def __init__(self, init: ModelInit, state_idx: int):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.linear_attn = OlmoHybridGatedDeltaNet(init, state_idx)
        self.post_attention_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mlp = LlamaMLP(init)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = h if residual is None else h + residual
        x = x + self.linear_attn(self.input_layernorm(x))
        return self.mlp(self.post_attention_layernorm(x)), x


class OlmoHybridModel(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        self.rotary_emb = RotaryEmbedding(c) if uses_rope(c) else None
        layers: list[nn.Module] = []
        attention_idx = state_idx = 0
        for kind in c.layer_types:
            if kind == LINEAR_ATTENTION:
                layers.append(OlmoHybridDeltaNetLayer(init, state_idx))
                state_idx += 1
            else:
                layers.append(Olmo2DecoderLayer(init, attention_idx, c.attention_bias, True, attention_spec))
                attention_idx += 1
        self.layers = nn.ModuleList(layers)
        self.norm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb.cos_sin(positions)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        return self.norm(h + residual)


class LinearHybridForCausalLM(CausalLM):
    """What OLMo Hybrid and Kimi Linear share: `layer_types` full_attention or linear_attention (a
    recurrent layer with a conv that runs SiLU), one model class under an output projection, tied or not.
    A subclass names its `model_class`, its `family` and its recurrent layers (`recurrent`) for refusals."""

    model_class: type[nn.Module]
    family: str
    recurrent: str

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.check_config(c)
        self.model = self.model_class(init)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Refuse a layer kind this class does not build, and a hidden_act other than silu: transformers
        applies hidden_act in the recurrent layers' conv too, which here runs SiLU."""
        unknown = set(hf_config.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown:
            raise ConfigError(
                f"{cls.family}: layer_types {sorted(map(str, unknown))} are not supported "
                "(full_attention, linear_attention)"
            )
        if hf_config.hidden_act != "silu":
            raise ConfigError(
                f"{cls.family} with hidden_act {hf_config.hidden_act!r} is not supported: {cls.recurrent}' "
                "conv runs SiLU (transformers applies hidden_act there too; the released models use silu)"
            )

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return hf_config.layer_types.count(FULL_ATTENTION)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)


class OlmoHybridForCausalLM(LinearHybridForCausalLM):
    unsplit_layers = (
        "the Gated DeltaNet layers (models/layers/gated_delta_net.py) have no split of their heads or state"
    )
    attention_spec = staticmethod(attention_spec)  # Llama's: no window on OLMo Hybrid's attention layers
    model_class = OlmoHybridModel
    family, recurrent = "OLMo Hybrid", "the delta nets"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, join_conv_parts(weights), (*DELTA_NET_STACKED, *STACKED), self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
            return None
        for old, new in RENAMED.items():
            name = name.replace(old, new)
        return name, tensor
