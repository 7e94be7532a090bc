"""Gemma 3n (text): the on-device Gemma between 3 and 4. Its attention, norms, per-layer inputs and KV
shared across layers are Gemma 4's (`models/gemma4.py`: w-scaled RMSNorms, q/k/v norms, attention scale 1,
the last `num_kv_shared_layers` layers reading the KV cache of the last earlier layer of their type and
keeping none), with one head size for every layer; what 3n has of its own, as transformers'
modeling_gemma3n.py computes it:

- AltUp: the residual stream is `altup_num_inputs` streams [A, T, H]. The embedding is the first; the
  others are learned projections of it rescaled to its RMS. Each layer predicts every stream from all of
  them (coefficients from a router over the active stream), runs on the active one's prediction, then
  corrects every stream by the layer's innovation; at the end the streams are projected back, rescaled,
  averaged and normalised
- LAuReL: a low-rank (`laurel_rank`) branch beside attention, added with it and scaled by 1/sqrt(2)
- activation sparsity (`activation_sparsity_pattern`, per layer): the MLP's gate keeps only what lies above
  mean + std x the normal quantile of the sparsity (0.95 in the first 10 layers as released)
- the MLP's width per layer (`intermediate_size` a list); per-layer inputs as Gemma 4's, ids outside the
  per-layer table reading its row 0, every scale a float32 tensor cast to the model's dtype
- the per-layer input joins streams 1.. (after AltUp's correction, scaled by `correct_output_scale`)
- a final logit soft-cap (30), tied embeddings; no MoE, K = V or per-layer head sizes
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import ModelInit
from pagellm.models.gemma import GemmaMLP
from pagellm.models.gemma4 import (
    Gemma4Attention,
    Gemma4ForCausalLM,
    Gemma4Model,
    Gemma4RMSNorm,
    Gemma4TextOfMultimodal,
    shared_kv_attention_spec,
)
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear
from pagellm.models.llama import SpecFn


def gemma3n_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    """Gemma 4's, every layer's heads and head size the config's own."""
    return shared_kv_attention_spec(hf_config, hf_config, dtype, block_size, layer_idx)


class Gemma3nAltUp(nn.Module):
    """AltUp's per-layer part (transformers' Gemma3nTextAltUp): `predict` before the layer, `correct`
    after it; streams are [A, T, H]."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        num, hidden = hf_config.altup_num_inputs, hf_config.hidden_size
        self.num, self.active = num, hf_config.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)
        self.correction_coefs = Linear(num, num, False, dtype)
        self.prediction_coefs = Linear(num, num * num, False, dtype)
        self.modality_router = Linear(hidden, num, False, dtype)
        self.router_norm = Gemma4RMSNorm(hidden, hf_config.rms_norm_eps, dtype)
        self.register_buffer("router_input_scale", torch.tensor(hidden**-1.0), persistent=False)

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        """[T, A]: tanh of the router over the normalised, scaled stream, in float32."""
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """Each stream plus a per-token mix of all of them: [A, T, H]."""
        coefs = self.prediction_coefs(self.modalities(streams[self.active]))
        coefs = coefs.reshape(-1, self.num, self.num).permute(0, 2, 1)  # [T, A, A]
        mixed = torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1)
        return (mixed + streams).contiguous().type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Every prediction moved by the layer's innovation (its output less the active prediction),
        weighted per stream and token."""
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        innovation = activated - predictions[self.active]
        corrected = innovation.unsqueeze(0) * coefs.permute(1, 0).unsqueeze(-1) + predictions
        return corrected.contiguous().type_as(activated)

    def scale_output(self, x: torch.Tensor) -> torch.Tensor:
        return (x.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(x)


class Gemma3nLaurel(nn.Module):
    """Learned augmented residual: x + norm(right(left(x))), `laurel_rank` wide between."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        hidden, rank = hf_config.hidden_size, hf_config.laurel_rank
        self.linear_left = Linear(hidden, rank, False, dtype)
        self.linear_right = Linear(rank, hidden, False, dtype)
        self.post_laurel_norm = Gemma4RMSNorm(hidden, hf_config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nMLP(GemmaMLP):
    """Gemma's gated MLP of this layer's width; with activation sparsity s the gate is first cut to
    relu(gate - (mean + std x Phi^-1(s))) over each token's features (the "gaussian top-k")."""

    def __init__(self, init: ModelInit, layer_idx: int):
        c = init.hf_config
        super().__init__(init, c.intermediate_size[layer_idx])
        self.sparsity = float(c.activation_sparsity_pattern[layer_idx])
        quantile = torch.distributions.normal.Normal(0, 1).icdf(
            torch.tensor(self.sparsity, dtype=torch.float32)
        )
        self.register_buffer("std_multiplier", quantile, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        if self.sparsity > 0.0:
            mean = gate.mean(dim=-1, keepdim=True)
            std = gate.std(dim=-1, keepdim=True, unbiased=False)
            gate = torch.relu(gate - (mean + std * self.std_multiplier.to(gate.dtype)))
        return self.down_proj(self.act.act(gate) * up)


class Gemma3nDecoderLayer(nn.Module):
    """AltUp around Gemma's four-norm layer with LAuReL beside attention, then the per-layer input added to
    every stream but the first."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        dtype, hidden = init.dtype, c.hidden_size
        norm = lambda: Gemma4RMSNorm(hidden, c.rms_norm_eps, dtype)  # noqa: E731
        self.altup = Gemma3nAltUp(c, dtype)
        self.input_layernorm = norm()
        self.laurel = Gemma3nLaurel(c, dtype)
        self.self_attn = Gemma4Attention(init, layer_idx, qkv_bias, spec_fn)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = Gemma3nMLP(init, layer_idx)
        self.post_feedforward_layernorm = norm()
        self.act = get_activation(c.hidden_activation)
        self.per_layer_input_gate = Linear(
            hidden, c.hidden_size_per_layer_input, False, dtype, init.quant_method
        )
        self.per_layer_projection = Linear(
            c.hidden_size_per_layer_input, hidden, False, dtype, init.quant_method
        )
        self.post_per_layer_input_norm = norm()
        self.correct_scale = c.altup_correct_scale

    def forward(
        self,
        streams: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        per_layer_input: torch.Tensor,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the streams after this layer [A, T, H], k, v of its attention)."""
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn, k, v = self.self_attn(normed, cos, sin, shared_kv)
        x = (active + self.post_attention_layernorm(attn) + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = self.altup.scale_output(first)
        gated = self.act(self.per_layer_input_gate(first)) * per_layer_input
        first = self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return torch.cat([corrected[:1], corrected[1:] + first]), k, v


def _rescaled(x: torch.Tensor, target_rms: torch.Tensor) -> torch.Tensor:
    """x with the RMS of each token set to `target_rms` (its own floored at sqrt(1e-5))."""
    rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target_rms / rms


class Gemma3nModel(Gemma4Model):
    """Gemma 4's skeleton (embedding, per-layer inputs, a rope per layer type, the shared K and V passed
    within a step) with AltUp's streams made from the embedding before the layers and merged after."""

    layer_class = Gemma3nDecoderLayer

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, qkv_bias, qk_norm, spec_fn)
        c = init.hf_config
        linears = lambda: nn.ModuleList(  # noqa: E731
            Linear(c.hidden_size, c.hidden_size, False, init.dtype, init.quant_method)
            for _ in range(1, c.altup_num_inputs)
        )
        self.altup_projections, self.altup_unembed_projections = linears(), linears()
        scales = {"per_layer_projection_scale": torch.tensor(c.hidden_size**-0.5)}
        scales["per_layer_input_scale"] = torch.rsqrt(torch.tensor(2.0))
        for name, value in scales.items():
            self.register_buffer(name, value.to(init.dtype), persistent=False)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        shape = (-1, len(self.layers), self.per_layer_size)
        in_table = (input_ids >= 0) & (input_ids < self.embed_tokens_per_layer.num_embeddings)
        ids = torch.where(in_table, input_ids, 0)
        tokens = (self.embed_tokens_per_layer(ids) * self.per_layer_embed_scale).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.per_layer_projection_scale
        return (
            self.per_layer_projection_norm(projected.reshape(shape)) + tokens
        ) * self.per_layer_input_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rope(positions)
        x = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, x)
        rms = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
        streams = torch.stack([x, *(_rescaled(p(x), rms) for p in self.altup_projections)])
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in self.own:
            source = self.sources[i]
            shared = kv[source] if source is not None else None
            streams, k, v = self.layers[i](streams, *rope[self.layer_rope[i]], per_layer[:, i], shared)
            kv[i] = (k, v)
        rms = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        merged = [
            streams[0],
            *(_rescaled(p(s), rms) for p, s in zip(self.altup_unembed_projections, streams[1:], strict=True)),
        ]
        return self.norm(torch.stack(merged).mean(dim=0))


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text decoder (config `Gemma3nTextConfig`, model_type gemma3n_text)."""

    attention_spec = staticmethod(gemma3n_attention_spec)
    model_class = Gemma3nModel
    unsplit_layers = "its AltUp streams, per-layer inputs and shared K and V cross layers, which the split layers do not pass on"


class Gemma3nTextOfMultimodal(Gemma3nForCausalLM, Gemma4TextOfMultimodal):
    """The text model of a Gemma 3n checkpoint with vision and audio (`Gemma3nForConditionalGeneration`, how
    Gemma 3n ships), for text-only use: the decoder under `model.language_model.`, the towers and their
    embedders not read (Gemma 4's same layout)."""
