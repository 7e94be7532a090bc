"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, transformers' `deepseek_v4`), as transformers computes it.

- attention (models/layers/compressed_attention.py): one shared K = V head per token (`kv_proj`, a
  float32-weighted RMSNorm, rope on its last qk_rope_head_dim features in interleaved pairs), queries
  through a low-rank `q_a_proj` -> `q_a_norm` -> `q_b_proj` with an unweighted RMSNorm per head; a
  sliding window on every layer, plus pooled rows on the compressed ones ("heavily_compressed_attention":
  one row per `compress_rate` tokens; "compressed_sparse_attention": overlapping windows, read through a
  lightning indexer's top k); a sink logit per head; the output's rope part rotated back by the query's
  position; the grouped low-rank output projection (`o_a_proj`, one block per group of heads, then
  `o_b_proj`). Sliding layers rotate with `rope_theta` ("main"), compressed ones, their pooled rows and
  the indexer with `compress_rope_theta` and the config's scaling ("compress").
- hyper-connections: the residual is `hc_mult` streams [T, hc, hidden]; before each block a float32
  projection of the normalised streams gives "pre" (collapse the streams into the block's input), "post"
  (spread its output back) and "comb" (mix the streams, made doubly stochastic by `hc_sinkhorn_iters`
  Sinkhorn-Knopp steps). After the last layer `hc_head` collapses the streams, then the final norm.
- mixture of experts on every layer: `mlp_layer_types` "hash_moe" picks each token's experts from a
  fixed table by token id (`tid2eid`), "moe" the top k of the scores (`scoring_func`, sqrtsoftplus by
  default) plus `e_score_correction_bias`; the chosen scores renormalised, times `routed_scaling_factor`;
  SwiGLU clamped at `swiglu_limit` in the experts and the one shared expert. Plain torch, expert by
  expert (no fused kernel, no expert parallelism).

What runs and what is refused at start-up (ConfigError): the per-token cache rows make chunked prefill,
preemption, prefix caching and speculative drafts (n-gram) work as for plain attention; refused are a
quantized checkpoint (the released FP8/FP4 experts: float checkpoints only), a KV cache dtype other than
the model's (the rows hold pooling gates), an attention backend other than TORCH_SDPA (the rows are read
slot-major, `index_topk` on the spec), tensor/pipeline parallelism (`supports_parallel`), LoRA (no
layer is one LoRA targets) and MTP drafting (the `mtp` method runs other families' heads); the
multi-token-prediction weights (`mtp.*`) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.compressed_attention import (
    CSA,
    KINDS,
    SLIDING,
    LayerShape,
    LayerTensors,
    Pooling,
    compressed_attention,
    cos_sin,
    rotate_tail,
    row_width,
    weighted_rms,
)
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.loader import copy_weights

SCORING = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
}
"""The router's `scoring_func`s (transformers' ACT2FN entries of those names; it has no "softmax", which its
config names, so that one is refused for want of a reference)."""
RENORMALIZE_EPS = 1e-20


def check_v4_config(c: Any) -> None:
    """Refuse what the layers here cannot run, naming it (a ConfigError at start-up)."""
    bad = sorted(set(c.layer_types) - set(KINDS))
    if bad:
        raise ConfigError(f"DeepSeek-V4 layer_types {bad} are not supported; supported: {', '.join(KINDS)}")
    if c.num_key_value_heads != 1:
        raise ConfigError(
            f"DeepSeek-V4 shares one K = V head; num_key_value_heads is {c.num_key_value_heads}"
        )
    if (c.num_attention_heads * c.head_dim) % c.o_groups or c.num_attention_heads % c.o_groups:
        raise ConfigError(
            f"DeepSeek-V4 o_groups {c.o_groups} does not divide the {c.num_attention_heads} heads"
        )
    if CSA in c.layer_types and c.index_head_dim < c.qk_rope_head_dim:
        raise ConfigError(
            f"DeepSeek-V4 index_head_dim {c.index_head_dim} is smaller than the rope part {c.qk_rope_head_dim}"
        )
    if c.scoring_func not in SCORING:
        raise ConfigError(f"DeepSeek-V4 scoring_func {c.scoring_func!r}; supported: {', '.join(SCORING)}")
    if (getattr(c, "quantization_config", None) or {}).get("quant_method"):
        raise ConfigError(
            "DeepSeek-V4 quantized checkpoints (the released FP8/FP4 weights) are not read; use a float one"
        )


def v4_attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    """One latent-style row per token (`row_width` of the layer's kind), read slot-major by the layer itself
    (`index_topk` set so that only a backend keeping such rows, TORCH_SDPA, is selected)."""
    c = hf_config
    return AttentionSpec(
        num_heads=c.num_attention_heads,
        num_kv_heads=1,
        head_size=row_width(c.layer_types[layer_idx], c.head_dim, c.index_head_dim),
        dtype=dtype,
        block_size=block_size,
        latent_kv=True,
        index_topk=c.index_topk,
    )


def rope_table(hf_config: Any, label: str) -> tuple[torch.Tensor, float]:
    """inv_freq and scaling of `rope_parameters[label]` ("main" or "compress"), as DeepseekV4RotaryEmbedding
    builds them: one frequency per interleaved pair of the qk_rope_head_dim rotated features."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters[label]
    kind = params.get("rope_type", "default")
    if kind == "default":
        rope_dim = hf_config.qk_rope_head_dim
        exps = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
        return 1.0 / (params["rope_theta"] ** exps), 1.0
    if kind not in ROPE_INIT_FUNCTIONS or kind in ("dynamic", "longrope"):
        raise ConfigError(f"DeepSeek-V4 {label} rope type {kind!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, None, layer_type=label)
    return inv_freq.float(), float(scaling)


class V4Rope(nn.Module):
    """The "main" and "compress" rotary tables of a step's positions, shared by every layer."""

    def __init__(self, hf_config: Any):
        super().__init__()
        self.scaling: dict[str, float] = {}
        for label in ("main", "compress"):
            inv_freq, self.scaling[label] = rope_table(hf_config, label)
            self.register_buffer(f"{label}_inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, label: str) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(positions, getattr(self, f"{label}_inv_freq"), self.scaling[label])


class V4Norm(nn.Module):
    """RMSNorm with a float32 weight (transformers keeps V4's norms in float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weighted_rms(x, self.weight, self.eps)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def linear(init: ModelInit, n_in: int, n_out: int, dtype: torch.dtype | None = None) -> nn.Linear:
    """A bias-free torch linear (no platform packing, no LoRA: V4 runs on plain torch layers)."""
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype or init.dtype)


class GroupedLinear(nn.Module):
    """`o_a_proj`: heads in `groups` groups, each group's features projected by its own block of rows."""

    def __init__(self, per_group: int, out_features: int, groups: int, dtype: torch.dtype):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, per_group, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, per_group] -> [T, out_features]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


class PoolProjections(nn.Module):
    """What each token gives a pooled series: `kv_proj` and `gate_proj` rows (`width` each), and the series'
    learnt `position_bias` [rate, width] and `kv_norm` (width // 2 for the overlapping CSA series)."""

    def __init__(self, init: ModelInit, width: int, rate: int, norm_size: int):
        super().__init__()
        c = init.hf_config
        self.kv_proj = linear(init, c.hidden_size, width)
        self.gate_proj = linear(init, c.hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = V4Norm(norm_size, c.rms_norm_eps)

    def rows(self, h: torch.Tensor) -> list[torch.Tensor]:
        return [self.kv_proj(h), self.gate_proj(h)]

    def pooling(self) -> Pooling:
        return Pooling(self.position_bias, self.kv_norm.weight)


class IndexerScorer(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.weights_proj = linear(init, c.hidden_size, c.index_n_heads)


class Indexer(PoolProjections):
    """The lightning indexer of a CSA layer: its own overlapping pooled series (index_head_dim), queries from
    the attention's low-rank query (`q_b_proj`) and a weight per head and token (`scorer.weights_proj`)."""

    def __init__(self, init: ModelInit, rate: int):
        c = init.hf_config
        super().__init__(init, 2 * c.index_head_dim, rate, c.index_head_dim)
        self.heads, self.dim = c.index_n_heads, c.index_head_dim
        self.q_b_proj = linear(init, c.q_lora_rank, self.heads * self.dim)
        self.scorer = IndexerScorer(init)

    def queries(self, h, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated queries [T, Hi, Di] and head weights [T, Hi] (float32, times Hi ** -0.5)."""
        q = rotate_tail(self.q_b_proj(q_resid).view(h.shape[0], self.heads, self.dim), cos, sin)
        return q, self.scorer.weights_proj(h).float() * self.heads**-0.5


class Compressor(PoolProjections):
    """The pooled series of a compressed layer (2 x head_dim per token, overlapping, with an indexer on a
    CSA layer; head_dim on an HCA layer)."""

    def __init__(self, init: ModelInit, kind: str):
        c = init.hf_config
        rate, overlap = c.compress_rates[kind], 2 if kind == CSA else 1
        super().__init__(init, overlap * c.head_dim, rate, c.head_dim)
        self.indexer = Indexer(init, rate) if kind == CSA else None

    def rows(self, h: torch.Tensor) -> list[torch.Tensor]:
        own = super().rows(h)
        return own if self.indexer is None else own + self.indexer.rows(h)


class V4Attention(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        kind = c.layer_types[layer_idx]
        self.rope_label = "main" if kind == SLIDING else "compress"
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.groups, self.eps = c.o_groups, c.rms_norm_eps
        self.q_a_proj = linear(init, c.hidden_size, c.q_lora_rank)
        self.q_a_norm = V4Norm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = linear(init, c.q_lora_rank, self.heads * self.head_dim)
        self.kv_proj = linear(init, c.hidden_size, self.head_dim)
        self.kv_norm = V4Norm(self.head_dim, c.rms_norm_eps)
        per_group = self.heads * self.head_dim // self.groups
        self.o_a_proj = GroupedLinear(per_group, self.groups * c.o_lora_rank, self.groups, init.dtype)
        self.o_b_proj = linear(init, self.groups * c.o_lora_rank, c.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        self.compressor = Compressor(init, kind) if kind != SLIDING else None
        rate = c.compress_rates[kind] if kind != SLIDING else 0
        # the pooled rows' rope, the layer's own (a compiled layer region reads only its own tensors)
        inv_freq, self.rope_scaling = rope_table(c, "compress")
        self.register_buffer("compress_inv_freq", inv_freq, persistent=False)
        self.shape = LayerShape(
            kind, c.head_dim, c.index_head_dim, rate, c.sliding_window, c.index_topk, self.eps
        )
        self.attn = Attention(init, v4_attention_spec(c, init.dtype, init.block_size, layer_idx), layer_idx)

    def forward(self, h: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        tokens = h.shape[0]
        cos, sin = tables[self.rope_label]
        q_resid = self.q_a_norm(self.q_a_proj(h))
        q = unweighted_rms(self.q_b_proj(q_resid).view(tokens, self.heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(h)).unsqueeze(1), cos, sin)[:, 0]
        rows, index = [kv], None
        if self.compressor is not None:
            rows += self.compressor.rows(h)
            if self.compressor.indexer is not None:
                index = self.compressor.indexer.queries(h, q_resid, *tables["compress"])
        out = compressed_attention(
            q, torch.cat(rows, dim=-1), index, self.attn.layer_index, self.shape, self._tensors()
        )
        out = rotate_tail(out, cos, -sin)  # V = K carried the keys' rope: undo it at the query's position
        return self.o_b_proj(self.o_a_proj(out.reshape(tokens, self.groups, -1)))

    def _tensors(self) -> LayerTensors:
        comp = self.compressor
        pool = comp.pooling() if comp is not None else None
        index_pool = comp.indexer.pooling() if comp is not None and comp.indexer is not None else None
        return LayerTensors(self.sinks, pool, index_pool, self.compress_inv_freq, self.rope_scaling)


class HyperConnection(nn.Module):
    """transformers' DeepseekV4HyperConnection (float32): the pre / post / comb weights from the streams."""

    def __init__(self, c: Any):
        super().__init__()
        hc = self.hc = c.hc_mult
        self.iters, self.hc_eps, self.eps = c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * c.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> post [T, hc], comb [T, hc, hc], the collapsed block input [T, D]."""
        hc = self.hc
        mixed = F.linear(unweighted_rms(streams.flatten(1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, summing to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The block's output spread over the streams (post) plus the streams mixed by comb's transpose."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """transformers' DeepseekV4HyperHead: the final collapse of the streams."""

    def __init__(self, c: Any):
        super().__init__()
        self.eps, self.hc_eps = c.rms_norm_eps, c.hc_eps
        self.hc_fn = nn.Parameter(torch.zeros(c.hc_mult, c.hc_mult * c.hidden_size), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(c.hc_mult), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(x.flatten(1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.limit = c.swiglu_limit
        self.gate_proj = linear(init, c.hidden_size, c.moe_intermediate_size)
        self.up_proj = linear(init, c.hidden_size, c.moe_intermediate_size)
        self.down_proj = linear(init, c.moe_intermediate_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """`mlp.gate`: the learnt scores; the experts from their top k plus the correction bias ("moe") or
    from the token's row of `tid2eid` ("hash_moe")."""

    def __init__(self, init: ModelInit, hashed: bool):
        super().__init__()
        c = init.hf_config
        self.top_k, self.factor = c.num_experts_per_tok, c.routed_scaling_factor
        self.score = SCORING[c.scoring_func]
        self.weight = nn.Parameter(
            torch.empty(c.n_routed_experts, c.hidden_size, dtype=init.dtype), requires_grad=False
        )
        self.hashed = hashed
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=torch.float32)
            )

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' experts [T, k] and their weights [T, k]."""
        scores = self.score(F.linear(h, self.weight))
        if self.hashed:
            chosen = self.tid2eid[input_ids].long()
        else:
            chosen = torch.topk(
                scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False
            ).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPS) * self.factor


class Experts(nn.Module):
    """The routed experts as transformers stores them: `gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]."""

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        e, i, d = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.limit = c.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d, dtype=init.dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, d, i, dtype=init.dtype), requires_grad=False)

    def forward(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Eager: straight to `run_experts`; compiling: the opaque op (its loop over the chosen experts is
        data-dependent, which a compiled layer region cannot hold)."""
        args = (h, chosen, weights, self.gate_up_proj, self.down_proj)
        if torch.compiler.is_compiling():
            return torch.ops.pagellm.v4_experts(*args, self.limit)
        return run_experts(*args, self.limit)


def run_experts(h, chosen, weights, gate_up, down, limit: float) -> torch.Tensor:
    """Each chosen expert over its tokens, weighted and summed into [T, D], expert by expert as transformers'
    DeepseekV4Experts adds them up."""
    out = torch.zeros_like(h)
    for e in chosen.unique().tolist():
        token, slot = torch.where(chosen == e)
        gate, up = F.linear(h[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, limit), down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@torch.library.custom_op("pagellm::v4_experts", mutates_args=())
def _v4_experts_op(
    h: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    return run_experts(h, chosen, weights, gate_up, down, limit)


@_v4_experts_op.register_fake
def _(h, chosen, weights, gate_up, down, limit) -> torch.Tensor:
    return torch.empty_like(h)


class V4MoE(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        self.gate = Router(init, init.hf_config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(init)
        self.shared_experts = SharedExpert(init)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(h, *self.gate(h, input_ids)) + self.shared_experts(h)


class V4DecoderLayer(nn.Module):
    def __init__(self, init: ModelInit, layer_idx: int):
        super().__init__()
        c = init.hf_config
        self.self_attn = V4Attention(init, layer_idx)
        self.mlp = V4MoE(init, layer_idx)
        self.input_layernorm = V4Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = V4Norm(c.hidden_size, c.rms_norm_eps)
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, tables: dict) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = hyper_residual(streams, post, comb, self.self_attn(self.input_layernorm(x), tables))
        post, comb, x = self.ffn_hc(streams)
        return hyper_residual(streams, post, comb, self.mlp(self.post_attention_layernorm(x), input_ids))


class V4Model(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.hc = c.hc_mult
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, init.dtype)
        self.layers = nn.ModuleList(V4DecoderLayer(init, i) for i in range(c.num_hidden_layers))
        self.norm = V4Norm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c)
        self.rope = V4Rope(c)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tables = {label: self.rope.cos_sin(positions, label) for label in ("main", "compress")}
        h = self.embed_tokens(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, tables)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    """DeepSeek-V4 on one rank, float checkpoints (see the module's docstring for what is refused)."""

    attention_spec = staticmethod(v4_attention_spec)
    supports_parallel = False
    unsplit_layers = "the compressed attention, hyper-connections and experts are plain torch layers"

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        check_v4_config(c)
        if init.quant_method is not None:
            raise ConfigError("DeepSeek-V4 runs float checkpoints only (no quantization method)")
        if init.kv_cache_dtype not in (None, init.dtype):
            raise ConfigError(
                "DeepSeek-V4 keeps each token's pooling gates in its KV cache rows: use --kv-cache-dtype auto"
            )
        self.model = V4Model(init)
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        )

    @classmethod
    def selection_spec(cls, hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """Any layer's spec (all are slot-major rows with `index_topk`), after the config's checks."""
        check_v4_config(hf_config)
        return v4_attention_spec(hf_config, dtype, block_size, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """DeepSeek's own names (what the released checkpoints and transformers' save_pretrained write) or
        transformers' (`checkpoint_name`); per-expert w1/w3/w2 go into the stacked expert tensors."""
        experts: set[str] = set()
        rest = self._load_experts(weights, experts)
        return copy_weights(self, rest, (), self._adapt) | experts

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]):
        """Copy each per-expert tensor into its stacked parameter (recording the name), yield the others."""
        for name, tensor in weights:
            found = EXPERT.match(checkpoint_name(name))
            if found is None:
                yield name, tensor
                continue
            experts, e, part = self.get_submodule(found[1]), int(found[2]), found[3]
            load_expert(experts, e, part, tensor)
            loaded.add(f"{found[1]}.{'down_proj' if part == 'w2' else 'gate_up_proj'}")

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        name = checkpoint_name(name)
        if ".mtp." in name or name.startswith("model.mtp") or (self.tied and name == "lm_head.weight"):
            return None  # the multi-token-prediction module is not loaded
        return name, tensor


RENAMES = [
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight", "embed_tokens.weight"),
        (r"^head\.weight", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
        (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"),
        (r"\.attn_sink", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    )
]
"""DeepSeek's checkpoint names -> transformers' (its conversion mapping for `deepseek_v4`, in its order);
transformers' own names pass through unchanged."""
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as this model's parameter: DeepSeek's names (with or without `model.`)
    renamed as transformers renames them, then under `model.` (but `lm_head`)."""
    name = name.removeprefix("model.")
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name if name == "lm_head.weight" else f"model.{name}"


def load_expert(experts: nn.Module, e: int, part: str, tensor: torch.Tensor) -> None:
    """Expert e's w1 (gate), w3 (up) or w2 (down) into the stacked `gate_up_proj` / `down_proj`."""
    if part == "w2":
        experts.down_proj.data[e].copy_(tensor)
        return
    half = experts.gate_up_proj.shape[1] // 2
    rows = slice(0, half) if part == "w1" else slice(half, 2 * half)
    experts.gate_up_proj.data[e, rows].copy_(tensor)
