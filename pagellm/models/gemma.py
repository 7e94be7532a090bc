"""The Gemma family: Gemma 2 and Gemma 3 (text). Llama's fused q/k/v and gate/up and its tensor and
pipeline parallel split, with Gemma's differences, each as transformers computes it:

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
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.distributed import Group
from pagellm.models.base import CausalLM, ModelInit, head_size, rank_heads, stage_layers
from pagellm.models.layers.activation import GatedActivation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear, Shard
from pagellm.models.layers.norm import GemmaRMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.models.llama import STACKED
from pagellm.models.loader import copy_weights


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


class GemmaAttention(nn.Module):
    """q/k/v column parallel by heads (a KV head replicated on several ranks when there are fewer KV heads
    than ranks), o_proj row parallel; optional per-head q/k norms before rotary."""

    def __init__(self, init: ModelInit, full: AttentionSpec, layer_idx: int, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        tp = init.parallel.tp
        spec = rank_heads(full, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        kv_head = tp.rank * full.num_kv_heads // tp.size  # this rank's first KV head
        kv = (kv_head * self.head_dim, self.kv_size)
        qkv_shard = Shard(0, ((tp.rank * self.q_size, self.q_size), kv, kv)) if tp.size > 1 else None
        bias = bool(getattr(c, "attention_bias", False))
        self.qkv_proj = Linear(
            c.hidden_size, sum(sizes), bias, init.dtype, init.quant_method, sizes, qkv_shard
        )
        o_shard = Shard(1, ((tp.rank * self.q_size, self.q_size),)) if tp.size > 1 else None
        self.o_proj = Linear(
            self.q_size, c.hidden_size, bias, init.dtype, init.quant_method, shard=o_shard, reduce=tp
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
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


class GemmaMLP(nn.Module):
    """gate/up column parallel, down row parallel; the activation is the config's `hidden_activation`."""

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        tp = init.parallel.tp
        size = c.intermediate_size // tp.size
        part = (tp.rank * size, size)
        self.gate_up_proj = Linear(
            c.hidden_size,
            2 * size,
            False,
            init.dtype,
            init.quant_method,
            [size, size],
            Shard(0, (part, part)) if tp.size > 1 else None,
        )
        self.act = GatedActivation(c.hidden_activation)
        self.down_proj = Linear(
            size,
            c.hidden_size,
            False,
            init.dtype,
            init.quant_method,
            shard=Shard(1, (part,)) if tp.size > 1 else None,
            reduce=tp,
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, spec: AttentionSpec, layer_idx: int, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(init, spec, layer_idx, qk_norm)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(init)
        self.post_feedforward_layernorm = norm()

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """With pipeline parallelism a stage builds only its own layers (the others are empty placeholders,
    so parameter names stay the checkpoint's); the first stage embeds, the last normalises and hands the
    final hidden states back to the first, which holds the output projection."""

    def __init__(self, init: ModelInit, spec_fn, qk_norm: bool):
        super().__init__()
        c = init.hf_config
        self.pp: Group = init.parallel.pp
        self.own = stage_layers(c.num_hidden_layers, self.pp)
        first, last = self.pp.rank == 0, self.pp.rank == self.pp.size - 1
        self.embed_tokens = (
            Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp) if first else None
        )
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weights' dtype (bf16
        # rounds sqrt(3072) = 55.43 to 55.5)
        self.register_buffer("embed_scale", torch.tensor(c.hidden_size**0.5).to(init.dtype), persistent=False)
        rotaries, self.layer_rope = layer_type_rotaries(c)
        self.rotaries = nn.ModuleList(rotaries)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(init, spec_fn(c, init.dtype, init.block_size, i), i, qk_norm)
            if i in self.own
            else nn.Identity()
            for i in range(c.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype) if last else None
        self.hidden_size, self.dtype = c.hidden_size, init.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = [rotary.cos_sin(positions) for rotary in self.rotaries]
        pp = self.pp
        if pp.rank == 0:
            h = self.embed(input_ids)
        else:
            h = self._receive(input_ids, pp.rank - 1)
        for i in self.own:
            h = self.layers[i](h, *rope[self.layer_rope[i]])
        if pp.rank < pp.size - 1:
            pp.send(h, pp.rank + 1)
            return self._receive(input_ids, pp.size - 1) if pp.rank == 0 else h
        h = self.norm(h)
        if pp.size > 1:
            pp.send(h, 0)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def _receive(self, input_ids: torch.Tensor, source: int) -> torch.Tensor:
        buffer = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)
        return self.pp.recv(buffer, source)


class Gemma2ForCausalLM(CausalLM):
    qk_norm: bool = False
    """RMSNorm over each head of q and k before rotary (Gemma 3)."""
    attention_spec = staticmethod(gemma2_attention_spec)
    supports_parallel = True
    model_class: type[GemmaModel] = GemmaModel

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        if getattr(c, "use_bidirectional_attention", False):
            raise ConfigError(
                f"{type(self).__name__} with use_bidirectional_attention (an embedding model's encoder) "
                f"is not supported; pagellm runs Gemma as a causal decoder"
            )
        self.model = self.model_class(init, self.attention_spec, self.qk_norm)
        self.tp = init.parallel.tp
        self.vocab_size = c.vocab_size
        self.final_soft_cap: float | None = getattr(c, "final_logit_softcapping", None)
        self.tied = bool(getattr(c, "tie_word_embeddings", True))
        self.first_stage = init.parallel.pp.rank == 0
        if not self.first_stage:
            self.lm_head = None
        elif self.tied:
            self.lm_head = self.model.embed_tokens
        else:
            rows = -(-c.vocab_size // self.tp.size)
            shard = Shard(0, ((self.tp.rank * rows, rows),)) if self.tp.size > 1 else None
            self.lm_head = Linear(c.hidden_size, rows, False, init.dtype, shard=shard)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.project_logits(hidden, self.lm_head.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]  # each rank's rows of the vocab
        cap = self.final_soft_cap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # in the logits' dtype, as transformers does

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if "rotary_emb." in name or (self.tied and name == "lm_head.weight"):
            return None
        if not self._on_this_stage(name):
            return None
        return name, tensor

    def _on_this_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this pipeline stage's modules."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.model.own
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return self.first_stage
        return True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder (config `Gemma3TextConfig`, model_type gemma3_text)."""

    qk_norm = True
    attention_spec = staticmethod(gemma3_attention_spec)
