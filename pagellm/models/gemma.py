"""The Gemma family: Gemma 2 and Gemma 3 (text), on Llama's skeleton (fused q/k/v and gate/up, the tensor
and pipeline parallel split, the head) with Gemma's differences, each as transformers computes it:

- RMSNorm scales by (1 + w), in float32 before the cast back; four norms per layer (around attention
  and around the MLP, each block's output normalised before the residual add)
- the embedding is multiplied by sqrt(hidden_size), a scalar cast to the model's dtype
- per-layer sliding window from `layer_types`; attention scale `query_pre_attn_scalar ** -0.5`
- gelu (tanh) gated MLP (`hidden_activation`), tied embeddings
- Gemma 2: attention logit soft-capping (`attn_logit_softcapping`)
- Gemma 3: per-head q/k RMSNorm, a rope per layer type (`rope_parameters` keyed by layer type: local
  and global bases, scaling on either); no attention soft-cap (transformers ignores the field)
- final logit soft-capping where the config sets `final_logit_softcapping`, in the logits' dtype
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit, head_size
from pagellm.models.layers.norm import GemmaRMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, SpecFn


def _layer_type(hf_config: Any, layer_idx: int) -> str:
    return hf_config.layer_types[layer_idx]


def _spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int, soft_cap: float | None):
    # transformers' sliding mask keeps kv_idx > q_idx - sliding_window: the window's tokens including
    # the query's own, which is what AttentionSpec.sliding_window means too
    sliding = _layer_type(hf_config, layer_idx) == "sliding_attention"
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
        sliding_window=hf_config.sliding_window if sliding else None,
        logits_soft_cap=soft_cap,
        scale=hf_config.query_pre_attn_scalar**-0.5,
    )


def gemma2_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    return _spec(hf_config, dtype, block_size, layer_idx, getattr(hf_config, "attn_logit_softcapping", None))


def gemma3_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    return _spec(hf_config, dtype, block_size, layer_idx, None)


def layer_type_rotaries(hf_config: Any) -> tuple[list[RotaryEmbedding], list[int]]:
    """The rotary embeddings and, per layer, the index of its own. `rope_parameters` keyed by layer type
    (Gemma 3) gives each type its own, built from a copy of the config holding that type's parameters; a
    flat one serves every layer."""
    params = hf_config.rope_parameters
    types = sorted(set(hf_config.layer_types))
    if not set(params) <= set(types):
        return [RotaryEmbedding(hf_config)], [0] * hf_config.num_hidden_layers
    rotaries = []
    for layer_type in types:
        if params.get(layer_type) is None:
            raise ConfigError(f"rope_parameters has no entry for the model's {layer_type!r} layers")
        config = copy.deepcopy(hf_config)
        config.rope_parameters = dict(params[layer_type])
        rotaries.append(RotaryEmbedding(config))
    return rotaries, [types.index(t) for t in hf_config.layer_types]


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's (1 + w) per-head q/k norms (Gemma 3)."""

    norm_class = GemmaRMSNorm


class GemmaMLP(LlamaMLP):
    """Llama's gated MLP; the activation is the config's `hidden_activation`."""

    activation_field = "hidden_activation"


class GemmaDecoderLayer(nn.Module):
    """Four norms: each block's input and its output, normalised before it joins the residual stream."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(init)
        self.post_feedforward_layernorm = norm()

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as LlamaModel passes them: the stream is h + residual."""
        x = h if residual is None else h + residual
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), x


class GemmaModel(LlamaModel):
    """Llama's skeleton (pipeline stages included) with Gemma's layers and norms, the embedding scaled by
    sqrt(hidden_size) and a rotary embedding per layer type."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, qkv_bias, qk_norm, spec_fn)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype (bf16
        # rounds sqrt(3072) = 55.43 to 55.5)
        hidden = init.hf_config.hidden_size
        self.register_buffer("embed_scale", torch.tensor(hidden**0.5).to(init.dtype), persistent=False)

    def init_rope(self, hf_config: Any) -> None:
        rotaries, self.layer_rope = layer_type_rotaries(hf_config)
        self.rotaries = nn.ModuleList(rotaries)

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [rotary.cos_sin(positions) for rotary in self.rotaries]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's head (tied by default), with Gemma's final logit soft-cap."""

    tied_by_default = True
    attention_spec = staticmethod(gemma2_attention_spec)
    model_class = GemmaModel

    def __init__(self, init: ModelInit):
        c = init.hf_config
        if getattr(c, "use_bidirectional_attention", False):
            raise ConfigError(
                f"{type(self).__name__} with use_bidirectional_attention (an embedding model's encoder) "
                f"is not supported; pagellm runs Gemma as a causal decoder"
            )
        super().__init__(init)
        self.final_soft_cap: float | None = getattr(c, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_soft_cap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # in the logits' dtype, as transformers does

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return None if "rotary_emb." in name else super()._adapt(name, tensor)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder (config `Gemma3TextConfig`, model_type gemma3_text)."""

    qk_norm = True
    attention_spec = staticmethod(gemma3_attention_spec)
