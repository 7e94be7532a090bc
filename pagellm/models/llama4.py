"""Llama 4 (`Llama4ForCausalLM`, the text model of Llama-4-Scout/Maverick; the text of a
`Llama4ForConditionalGeneration` checkpoint too). The Llama decoder, with:

- two kinds of attention layer. Rope layers (`no_rope_layers[i]` 1) rotate q and k in interleaved pairs
  (x0, x1), (x2, x3), ... (transformers multiplies complex numbers, in float32), then, with `use_qk_norm`,
  L2-normalise each head of q and k (no weight); and with `attention_chunk_size` C they attend only within
  their chunk of C positions (chunked local attention, `AttentionSpec.attention_chunk`: a query at p sees
  [p // C * C, p]). NoPE layers (every fourth) attend to the whole context without rotary, and with
  `attn_temperature_tuning` scale q by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at position p,
  so long contexts do not flatten their softmax.
- MoE layers (`moe_layers`, every `interleave_moe_layer_step`-th) beside dense ones (`intermediate_size_mlp`
  wide). The router takes the top k logits and their sigmoids; unlike most families the score multiplies
  the expert's INPUT, not its output (expert(s * x), not s * expert(x)), and a shared expert (of
  `intermediate_size`) adds for every token.

The checkpoint keeps the experts stacked, `experts.gate_up_proj` [E, H, 2I] with gate in the first I columns
and up in the last I, `experts.down_proj` [E, I, H]; gate_up is interleaved on load into the layout
`FusedMoE` reads (GPT-OSS's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SIGMOID, Routing
from pagellm.models.layers.rotary import rotate_pairs
from pagellm.models.llama import (
    STACKED,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    SpecFn,
    attention_spec,
)
from pagellm.models.loader import CheckpointSlice


def llama4_attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    """Layers `layer_types` marks "chunked_attention" (the rope layers, when `attention_chunk_size` is set)
    attend within their chunk; the others to the whole context."""
    spec = attention_spec(hf_config, dtype, block_size, layer_idx)
    chunked = hf_config.layer_types[layer_idx] == "chunked_attention"
    return dataclasses.replace(spec, attention_chunk=hf_config.attention_chunk_size if chunked else None)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head scaled to unit root mean square, in float32 (transformers' `Llama4TextL2Norm`: no weight)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """float32 [T]: the NoPE layers' q scale at each position (transformers' attention-temperature tuning)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(LlamaAttention):
    """Llama's projections; rotary in pairs and the L2 q/k norm on rope layers, the temperature on NoPE
    layers. `forward`'s (cos, sin) on a NoPE layer is (the step's q scales or None, None)."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, False, spec_fn)
        c = init.hf_config
        self.use_rope = bool(c.no_rope_layers[layer_idx])
        self.l2_eps = c.rms_norm_eps if c.use_qk_norm and self.use_rope else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
            if self.l2_eps is not None:
                q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        elif cos is not None:  # the temperature scales
            q = (q * cos[:, None, None]).to(q.dtype)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class Llama4MoE(SparseMoeBlock):
    """Routed experts (top k of the router's logits, weighted by their sigmoids applied to the expert's
    input) and the shared expert. Each of the k choices runs the experts once as top-1 routing with weight
    1 on its own scaled input: sum_j expert_{id_j}(s_j * x), the same sum transformers takes over all
    experts (an unchosen one gets input 0 and, having no biases, gives 0)."""

    def __init__(self, init: ModelInit):
        c = init.hf_config
        routing = Routing(c.num_experts_per_tok, SIGMOID)
        shared = LlamaMLP(init, c.intermediate_size, reduce=False)
        super().__init__(init, routing, c.intermediate_size, activation=c.hidden_act, shared_expert=shared)
        self.top_k = c.num_experts_per_tok

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden.to(self.gate.dtype))
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(values.float()).to(hidden.dtype)
        ones = torch.ones(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)
        out = self.shared_expert(hidden)
        for j in range(self.top_k):
            out = out + self.experts(hidden * scores[:, j : j + 1], ones, ids[:, j : j + 1])
        return self.tp.all_reduce(out)


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if layer_idx in c.moe_layers:
            return Llama4MoE(init)
        return LlamaMLP(init, c.intermediate_size_mlp)


class Llama4Model(LlamaModel):
    """`rope` gives two entries: the rope layers' (cos, sin) and the NoPE layers' (q scales, None), the
    scales None without `attn_temperature_tuning`."""

    layer_class = Llama4DecoderLayer

    def init_rope(self, hf_config) -> None:
        super().init_rope(hf_config)
        self.layer_rope = [0 if use else 1 for use in hf_config.no_rope_layers]
        tuning = getattr(hf_config, "attn_temperature_tuning", False)
        self.temperature = (float(hf_config.floor_scale), float(hf_config.attn_scale)) if tuning else None

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        scales = None if self.temperature is None else temperature_scales(positions, *self.temperature)
        return [self.rotary_emb.cos_sin(positions), (scales, None)]


class Llama4ForCausalLM(LlamaForCausalLM):
    attention_spec = staticmethod(llama4_attention_spec)
    model_class = Llama4Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """transformers' `feed_forward` is the layer's `mlp` here, its `router` the block's `gate`; the
        stacked gate_up of the experts (gate, then up) is interleaved as `FusedMoE` reads it."""
        name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
        if name.endswith(".mlp.experts.gate_up_proj"):
            full = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
            gate, up = full.chunk(2, dim=-1)
            tensor = torch.stack((gate, up), dim=-1).flatten(-2)
        return super()._adapt(name, tensor)


class Llama4TextOfMultimodal(Llama4ForCausalLM):
    """The text model of a Llama 4 multimodal checkpoint (`Llama4ForConditionalGeneration`, how Llama 4
    ships), for text-only use: the engine runs its `text_config` (engine/setup.py), the decoder's weights
    come under `language_model.`, and the vision tower's and projector's are not read."""

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith(("vision_model.", "multi_modal_projector.")):
            return None
        return super()._adapt(name.removeprefix("language_model."), tensor)
