"""Gemma 4 (text): Gemma 3's decoder (four norms per layer, sliding and full attention by `layer_types`, a
rope per layer type, gelu-tanh MLP, the embedding scaled by sqrt(hidden)) with what Gemma 4 adds, each as
transformers' modeling_gemma4.py computes it:

- RMSNorm scales by w, not 1 + w, in float32 before the cast back; v is normalised too (no weight), and
  the attention scale is 1 (the q/k norms stand in for it); no attention soft-cap
- per-layer shapes: the full-attention layers have their own head size (`global_head_dim`) and, with
  `attention_k_eq_v`, their own KV heads (`num_global_key_value_heads`) and no v_proj: V is the k
  projection, normalised without weight and not rotated (transformers' `per_layer_config`, which makes
  `head_dim` unreadable on the config itself: every read here goes through `layer_config`)
- the full layers' "proportional" rope: the first `partial_rotary_factor` of each head's frequency pairs
  rotate (a quarter as released), the rest have a zero frequency (pairs (i, i + D/2), as rotate_half
  pairs them, not the first features as a partial rotary does); transformers' own rope functions build it
- KV shared across layers: the last `num_kv_shared_layers` layers compute no K or V; each reads those of
  the last earlier layer of its type. Here such a layer's attention spec names that layer
  (`AttentionSpec.kv_source`), so it keeps no KV cache of its own (core/kv_cache_spec.py), and it hands
  the backend that layer's k and v of the step (the same bytes stored again at the same slots, so no
  backend needs to know). With `use_double_wide_mlp` those layers' MLPs are twice as wide
- per-layer input embeddings (`hidden_size_per_layer_input` P): a second token table of L x P per token
  plus a projection of the embedding, mixed, and in each layer gated into the residual stream after the MLP
- `enable_moe_block`: routed experts beside the dense MLP in every layer, each branch normalised, summed,
  then normalised again; the router normalises its input (no weight), scales it by a learned vector and
  1/sqrt(hidden), takes a softmax top-k, renormalises and multiplies each weight by its expert's scale
- `layer_scalar`: every layer's output stream is multiplied by a learned scalar
- a final logit soft-cap where the config sets one; tied embeddings
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.gemma import GemmaMLP
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.fused_moe.layer import FusedMoE
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX, Routing, select_experts
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.models.llama import STACKED, LlamaForCausalLM, LlamaModel, SpecFn
from pagellm.models.loader import CheckpointSlice

SLIDING = "sliding_attention"


def layer_config(hf_config: Any, layer_idx: int | str) -> Any:
    """The config of one layer (or layer type): transformers' `per_layer_config` resolves the full layers'
    head size and KV heads, which the config itself refuses to give once they differ between layers."""
    return hf_config.per_layer_config[layer_idx]


def kv_sources(hf_config: Any) -> list[int | None]:
    """Per layer, the layer whose K and V it reads (None: its own). transformers' `kv_sharing_modes`: from
    layer L - num_kv_shared_layers on, a layer reuses the last earlier non-shared layer of its type."""
    n, shared = hf_config.num_hidden_layers, hf_config.num_kv_shared_layers or 0
    first = n - shared
    if shared and first <= 0:
        raise ConfigError(
            f"num_kv_shared_layers {shared} of {n} layers: every layer would read K and V that another model "
            "computes (a Gemma 4 assistant fed by its target), which pagellm does not run"
        )
    types = hf_config.layer_types
    sources: list[int | None] = [None] * first
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ConfigError(f"layer {i} ({types[i]}) shares KV, but no earlier layer of its type has one")
        sources.append(owners[-1])
    return sources


def kv_stores(hf_config: Any) -> dict[str, int]:
    """Per layer type, the last layer of that type that keeps its own KV (transformers' "store" layers): the
    KV a Gemma 4 assistant reads."""
    sources = kv_sources(hf_config)
    return {t: i for i, t in enumerate(hf_config.layer_types) if sources[i] is None}


def gemma4_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    return shared_kv_attention_spec(
        hf_config, layer_config(hf_config, layer_idx), dtype, block_size, layer_idx
    )


def shared_kv_attention_spec(
    hf_config: Any, layer: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    """Gemma 4's and Gemma 3n's: unscaled scores, a window on the sliding layers, K and V read from another
    layer's cache on the shared ones; heads, head size and window read from `layer` (Gemma 4's per-layer
    config, Gemma 3n's whole one)."""
    # transformers' sliding mask keeps kv_idx > q_idx - sliding_window, as AttentionSpec.sliding_window does
    sliding = hf_config.layer_types[layer_idx] == SLIDING
    return AttentionSpec(
        num_heads=layer.num_attention_heads,
        num_kv_heads=layer.num_key_value_heads,
        head_size=layer.head_dim,
        dtype=dtype,
        block_size=block_size,
        sliding_window=layer.sliding_window if sliding else None,
        scale=1.0,
        kv_source=kv_sources(hf_config)[layer_idx],
    )


def rotaries_by_layer_type(hf_config: Any) -> tuple[nn.ModuleList, list[int]]:
    """A rotary embedding per layer type, from that type's rope parameters and head size, and each layer's
    index into them (a Gemma 4 model's and its assistant's)."""
    types = sorted(set(hf_config.layer_types))
    rotaries = []
    for layer_type in types:
        params = hf_config.rope_parameters.get(layer_type)
        if params is None:
            raise ConfigError(f"rope_parameters has no entry for the model's {layer_type!r} layers")
        config = copy.copy(layer_config(hf_config, layer_type))  # its head size
        config.rope_parameters = dict(params)
        rotaries.append(RotaryEmbedding(config))
    return nn.ModuleList(rotaries), [types.index(t) for t in hf_config.layer_types]


class Gemma4RMSNorm(RMSNorm):
    """RMSNorm scaled by w (not 1 + w) in float32, then cast back; `with_scale` False: no weight at all
    (v's norm, the router's)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, with_scale: bool = True):
        super().__init__(size, eps, dtype)
        if not with_scale:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)  # transformers' pow, not rsqrt
        if self.weight is not None:
            h = h * self.weight.float()
        return h.to(x.dtype)


class Gemma4Attention(nn.Module):
    """q/k/v fused as the layer has them: q, k and v; q and k where K = V (`attention_k_eq_v`, full layers);
    q alone in a layer that reads another layer's K and V."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        spec = spec_fn(c, init.dtype, init.block_size, layer_idx)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.reads_kv = spec.kv_source is not None
        k_eq_v = getattr(c, "attention_k_eq_v", False) and c.layer_types[layer_idx] != SLIDING  # none in 3n
        parts = 1 if self.reads_kv else 2 if k_eq_v else 3
        self.sizes = [self.q_size] + [self.kv_size] * (parts - 1)
        dtype, eps = init.dtype, c.rms_norm_eps
        self.qkv_proj = Linear(c.hidden_size, sum(self.sizes), qkv_bias, dtype, init.quant_method, self.sizes)
        self.o_proj = Linear(self.q_size, c.hidden_size, c.attention_bias, dtype, init.quant_method)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps, dtype)
        self.k_norm = None if self.reads_kv else Gemma4RMSNorm(self.head_dim, eps, dtype)
        self.v_norm = None if self.reads_kv else Gemma4RMSNorm(self.head_dim, eps, dtype, with_scale=False)
        self.attn = Attention(init, spec, layer_idx)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, k, v): k and v as stored, for the layers that read this one's; `shared_kv`: the k and v
        of the layer this one reads."""
        parts = self.qkv_proj(h).split(self.sizes, dim=-1)
        q = apply_rotary(self.q_norm(parts[0].reshape(-1, self.num_heads, self.head_dim)), cos, sin)
        if shared_kv is not None:
            k, v = shared_kv
        else:
            k = parts[1].reshape(-1, self.num_kv_heads, self.head_dim)
            v = self.v_norm(parts[-1].reshape(-1, self.num_kv_heads, self.head_dim))  # K = V: k's projection
            k = apply_rotary(self.k_norm(k), cos, sin).reshape(-1, self.kv_size)
            v = v.reshape(-1, self.kv_size)
        out = self.attn(q.reshape(-1, self.q_size), k, v)
        return self.o_proj(out), k, v


class Gemma4Router(nn.Module):
    """The experts' router (transformers' Gemma4TextRouter): RMSNorm without weight, times `scale` and
    1/sqrt(hidden), a linear map to the experts' logits, softmax top-k renormalised, each weight times its
    expert's `per_expert_scale`."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        hidden, experts = hf_config.hidden_size, hf_config.num_experts
        self.norm = Gemma4RMSNorm(hidden, hf_config.rms_norm_eps, dtype, with_scale=False)
        self.proj = Linear(hidden, experts, False, dtype)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=dtype), requires_grad=False)
        self.root = hidden**-0.5
        self.routing = Routing(top_k=hf_config.top_k_experts, scoring=SOFTMAX, renormalize=True)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, K] float32, topk_ids [T, K])."""
        weights, ids = select_experts(self.proj(self.norm(h) * self.scale * self.root), self.routing)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """Gemma's four norms around attention and the MLP, then (where the model has them) the experts beside
    the MLP, the per-layer input gated in, and the layer's scalar. It passes the residual stream whole (no
    (h, residual) split: the scalar multiplies the whole stream)."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__()
        c = init.hf_config
        dtype, hidden = init.dtype, c.hidden_size
        norm = lambda size=hidden: Gemma4RMSNorm(size, c.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(init, layer_idx, qkv_bias, spec_fn)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        wide = 2 if c.use_double_wide_mlp and self.self_attn.reads_kv else 1
        self.mlp = GemmaMLP(init, layer_config(c, layer_idx).intermediate_size * wide)
        self.post_feedforward_layernorm = norm()
        self.experts = None
        if c.enable_moe_block:
            self.router = Gemma4Router(c, dtype)
            self.experts = FusedMoE(
                c.num_experts, hidden, c.moe_intermediate_size, dtype, activation=c.hidden_activation,
                quant_method=init.quant_method,
            )  # fmt: skip
            self.post_feedforward_layernorm_1 = norm()
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_2 = norm()
        self.per_layer_input_gate = None
        if c.hidden_size_per_layer_input:
            size = c.hidden_size_per_layer_input
            self.act = get_activation(c.hidden_activation)
            self.per_layer_input_gate = Linear(hidden, size, False, dtype, init.quant_method)
            self.per_layer_projection = Linear(size, hidden, False, dtype, init.quant_method)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the stream after this layer, k, v of its attention)."""
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, shared_kv)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        if self.experts is not None:
            # the router and the experts read the stream before the MLP, as the MLP's norm does
            weights, ids = self.router(x)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(m)
        if self.per_layer_input_gate is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, k, v


class Gemma4Model(LlamaModel):
    """Llama's skeleton (embedding, layers, final norm) with Gemma 4's layers, a rope per layer type from
    that type's own config (its head size), the per-layer inputs and the shared K and V passed from layer
    to layer within a step."""

    layer_class = Gemma4DecoderLayer
    norm_class = Gemma4RMSNorm

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, qkv_bias, qk_norm, spec_fn)
        c = init.hf_config
        self.sources = kv_sources(c)
        # transformers keeps each scale as a float32 tensor cast to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(c.hidden_size**0.5).to(init.dtype), persistent=False)
        self.per_layer_size = size = c.hidden_size_per_layer_input or 0
        if size:
            width = c.num_hidden_layers * size
            self.embed_tokens_per_layer = Embedding(c.vocab_size_per_layer_input, width, init.dtype)
            self.register_buffer(
                "per_layer_embed_scale", torch.tensor(size**0.5).to(init.dtype), persistent=False
            )
            self.per_layer_model_projection = Linear(
                c.hidden_size, width, False, init.dtype, init.quant_method
            )
            self.per_layer_projection_norm = Gemma4RMSNorm(size, c.rms_norm_eps, init.dtype)

    def init_rope(self, hf_config: Any) -> None:
        self.rotaries, self.layer_rope = rotaries_by_layer_type(hf_config)

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [rotary.cos_sin(positions) for rotary in self.rotaries]

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: the token's rows of the per-layer table (scaled by sqrt(P)) and the normalised projection
        of its embedding (scaled by 1/sqrt(hidden)), added and scaled by 1/sqrt(2)."""
        shape = (-1, len(self.layers), self.per_layer_size)
        tokens = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.reshape(shape)) + tokens) * 2.0**-0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rope(positions)
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_size else None
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in self.own:
            source = self.sources[i]
            extra = per_layer[:, i] if per_layer is not None else None
            x, k, v = self.layers[i](
                x, *rope[self.layer_rope[i]], extra, kv[source] if source is not None else None
            )
            kv[i] = (k, v)
        return self.norm(x)


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Gemma 4's text decoder (config `Gemma4TextConfig`, model_type gemma4_text)."""

    tied_by_default = True
    attention_spec = staticmethod(gemma4_attention_spec)
    model_class = Gemma4Model
    supports_parallel = False
    unsplit_layers = (
        "its layers read K and V and per-layer inputs across layers, which the split layers do not pass on"
    )

    def __init__(self, init: ModelInit):
        c = init.hf_config
        if getattr(c, "use_bidirectional_attention", None) == "all":
            raise ConfigError(
                f"{type(self).__name__} with use_bidirectional_attention 'all' (every token attending both "
                "ways) is not supported; pagellm runs Gemma 4 as a causal decoder"
            )
        super().__init__(init)
        self.final_soft_cap: float | None = getattr(c, "final_logit_softcapping", None)

    @classmethod
    def selection_spec(cls, hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """Every layer's spec must suit the backend: a sliding layer's window, but a full layer's head size
        (Gemma 4's larger one), so the selector checks the larger head size with a window."""
        spec = super().selection_spec(hf_config, dtype, block_size)
        head = max(layer_config(hf_config, i).head_dim for i in range(hf_config.num_hidden_layers))
        return dataclasses.replace(spec, head_size=head, kv_source=None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # in the logits' dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, _per_expert(weights), STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return None if "rotary_emb." in name else super()._adapt(name, tensor)


def _per_expert(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Gemma 4's stacked experts as per-expert tensors: `experts.gate_up_proj` [E, 2I, H] (gate rows, then
    up rows) and `experts.down_proj` [E, H, I], which `FusedMoE` reads as `experts.{e}.gate_proj.weight`..."""
    for name, tensor in weights:
        head, found, rest = name.rpartition(".experts.")
        if not found or rest not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        t = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
        for e in range(t.shape[0]):
            if rest == "down_proj":
                yield f"{head}.experts.{e}.down_proj.weight", t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                yield f"{head}.experts.{e}.gate_proj.weight", gate
                yield f"{head}.experts.{e}.up_proj.weight", up


class Gemma4TextOfMultimodal(Gemma4ForCausalLM):
    """The text model of a Gemma 4 checkpoint with vision and audio (`Gemma4ForConditionalGeneration`, how
    Gemma 4 ships), for text-only use: the engine runs its `text_config` (engine/setup.py), the decoder's
    weights come under `model.language_model.`, and the towers and their embedders are not read."""

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith(
            ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
        ):
            return None
        return super()._adapt(name.replace("model.language_model.", "model.", 1), tensor)
