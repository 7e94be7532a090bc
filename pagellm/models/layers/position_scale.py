"""Position-dependent scaling of the query: Mistral's long-context attention temperature.

Ministral 3 and Mistral 4 multiply every query, after its rotation, by

    scale(p) = 1 + beta * log(1 + floor(p / original_max_position_embeddings))

for the token at position p (transformers' `get_llama_4_attn_scale`, named after the Llama 4 scheme it
comes from; `beta` is the rope parameters' `llama_4_scaling_beta`). The scale is 1 inside the original
context and grows by steps of one log every original length after it, so that attention stays sharp
where YaRN has stretched the positions. Scaling q scales each query's scores before the softmax, which
the attention backends cannot do per token, so the layers scale q themselves: it is one multiply per
query row, the same in prefill and decode, and the KV cache is unchanged (keys are not scaled).

Llama 4's own attention temperature (`attn_temperature_tuning`, on its NoPE layers) has the same shape with
other details (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1); `position_log_scale` takes the
offset, and a family that needs log1p's rounding exactly should add it here rather than copy this.
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.core.errors import ConfigError


def position_log_scale(positions: torch.Tensor, beta: float, interval: int, offset: int = 0) -> torch.Tensor:
    """[T] float32: 1 + beta * log(1 + floor((positions + offset) / interval)), computed as transformers
    computes it (float32 division of the integer positions, then floor and log)."""
    steps = torch.floor((positions + offset) / interval)
    return 1 + beta * torch.log(1 + steps)


def llama_4_scaling(hf_config: Any) -> tuple[float, int]:
    """(beta, original_max_position_embeddings) from the rope parameters of a Ministral 3 or Mistral 4
    config. Both are required: transformers multiplies by them unconditionally (a config without them fails
    there too), so one missing is refused at start-up rather than guessed."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if beta is None or not original:
        raise ConfigError(
            f"{hf_config.model_type} config: rope_parameters must state llama_4_scaling_beta and "
            f"original_max_position_embeddings (the query's position scaling; got {beta!r} and {original!r})"
        )
    return float(beta), int(original)


def scale_query(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [T, heads, head_dim] times its token's scale [T], in q's dtype as transformers multiplies."""
    return q * scale.to(q.dtype)[:, None, None]


class PositionScaledQueries:
    """Mixed in before a `LlamaModel` subclass (Ministral 3's, Mistral 4's): its `rope` hands every layer
    (cos, sin, q_scale), the scale [T] computed once per step from the positions beside cos and sin; the
    config's parameters are read (or refused) with the rotary embedding's."""

    def init_rope(self, hf_config: Any) -> None:
        super().init_rope(hf_config)
        self.q_scaling = llama_4_scaling(hf_config)

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        scale = position_log_scale(positions, *self.q_scaling)
        return [(*cos_sin, scale) for cos_sin in super().rope(positions)]


class PositionScaledLayer:
    """Mixed in before a decoder layer with Llama's pre-norm residual steps (Ministral 3's, Mistral 4's): the
    same steps, handing its attention the step's q_scale beside cos and sin."""

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.self_attn(h, cos, sin, q_scale)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual
