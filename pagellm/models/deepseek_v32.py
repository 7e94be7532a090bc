"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, transformers' `deepseek_v32`): DeepSeek-V3 whose MLA reads, for
each query, only the `index_topk` earlier tokens a lightning indexer picks (DeepSeek Sparse Attention,
models/layers/sparse_attention.py). The projections, rope, MoE and loading are V3's (models/deepseek.py);
this file adds the indexer to each attention layer and its key cache as attention layers of their own.
GLM-5 (`GlmMoeDsaForCausalLM`, transformers' `glm_moe_dsa`) is the same with the indexer's rope in
interleaved pairs and indexers only on the layers `indexer_types` calls "full": a "shared" layer has no
indexer and no indexer cache, and attends over the tokens the last full layer chose in the same step.

Attention layers: the model's L MLA layers keep layer_idx 0..L-1 (latent rows, `index_topk` on the spec)
and the j-th indexed layer's key cache is attention layer L + j (`indexer_cache_spec`), so the engine lays
the cache out in KV-cache groups of the latent rows and of the indexer's keys (a block id has room for
both; a group's block leaves the other shape's room idle, core/kv_cache_spec.py).

The indexer's query reads MLA's low-rank query, so q_lora_rank is required (transformers' config requires
it too). Refused at start-up: an indexer head smaller than the rope part, an int8 KV cache (its rows carry
scales the gather does not read), any attention backend but TORCH_SDPA (the one whose cache rows the
gather reads: `supports_index_topk`), and tensor or pipeline parallelism (`supports_parallel`: the
indexer is not split).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.deepseek import (
    DeepseekDecoderLayer,
    DeepseekModel,
    DeepseekV3ForCausalLM,
    MLAAttention,
    mla_attention_spec,
)
from pagellm.models.layers.position_scale import scale_query
from pagellm.models.layers.sparse_attention import (
    Indexer,
    indexer_cache_spec,
    shared_sparse_mla_attention,
    sparse_mla_attention,
)
from pagellm.models.llama import SpecFn


def check_v32_config(hf_config: Any) -> None:
    """Refuse what the sparse layers cannot run, naming it (a ConfigError at start-up)."""
    c = hf_config
    if c.index_head_dim < c.qk_rope_head_dim:
        raise ConfigError(
            f"DeepSeek-V3.2 index_head_dim {c.index_head_dim} is smaller than qk_rope_head_dim "
            f"{c.qk_rope_head_dim}: the indexer rotates its first qk_rope_head_dim features"
        )
    kinds = getattr(c, "indexer_types", None) or ["full"]
    if kinds[0] != "full" or set(kinds) - {"full", "shared"}:
        raise ConfigError(
            f"indexer_types {kinds}: the first layer must be 'full' (a 'shared' layer reads the last full "
            "layer's choice) and every entry 'full' or 'shared'"
        )
    if c.index_topk < 1:
        raise ConfigError(f"DeepSeek-V3.2 index_topk must be at least 1, got {c.index_topk}")


def indexed_layers(hf_config: Any) -> list[int]:
    """The layers that run an indexer ("full" in GLM-5's `indexer_types`; every layer of DeepSeek-V3.2);
    the others ("shared") read the last such layer's choice of the step."""
    kinds = getattr(hf_config, "indexer_types", None) or ["full"] * hf_config.num_hidden_layers
    return [i for i, kind in enumerate(kinds) if kind == "full"]


def v32_attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    """Layers 0..L-1: MLA's latent rows, read sparsely (`index_topk`); L..2L-1: the indexers' key caches."""
    layers = hf_config.num_hidden_layers
    if layer_idx >= layers:
        return indexer_cache_spec(hf_config, dtype, block_size)
    spec = mla_attention_spec(hf_config, dtype, block_size, layer_idx)
    return dataclasses.replace(spec, index_topk=hf_config.index_topk)


class SparseMLAAttention(MLAAttention):
    """V3's MLA (absorbed queries over one latent row per token) over the tokens its indexer selects, or
    without an indexer over those the last full layer selected (GLM-5's "shared" layers); the MLA rope is
    interleaved, as transformers' DeepseekV32Attention always rotates it. `interleaved_index`: the
    indexer's rope in pairs too (GLM-5), in halves (DeepSeek-V3.2)."""

    def __init__(self, init: ModelInit, layer_idx: int, spec_fn: SpecFn, interleaved_index: bool = False):
        super().__init__(init, layer_idx, spec_fn, interleaved=True)
        if init.kv_cache_dtype == torch.int8:
            raise ConfigError(
                "DeepSeek sparse attention with an int8 KV cache is not supported: the sparse gather reads "
                "plain rows (use --kv-cache-dtype auto, or an fp8 type)"
            )
        full = indexed_layers(init.hf_config)
        self.indexer = None
        if layer_idx in full:
            cache_idx = init.hf_config.num_hidden_layers + full.index(layer_idx)
            self.indexer = Indexer(init, cache_idx, interleaved_index)
        else:  # the last full layer's choice
            source = torch.tensor(max(i for i in full if i < layer_idx), dtype=torch.int64, device="cpu")
            self.register_buffer("source_index", source, persistent=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        tokens = h.shape[0]
        q, latent = self.fused_qkv_a_proj(h).split([self.q_in, self.rank + self.rope], dim=-1)
        q_resid = self.q_a_layernorm(q)  # the indexer's query reads it too
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        c_kv, k_pe = latent.split([self.rank, self.rope], dim=-1)
        q = torch.cat([self.kv_b_proj.absorb_query(q_nope), self._rotate(q_pe, cos, sin)], dim=-1)
        if q_scale is not None:
            q = scale_query(q, q_scale)
        k = torch.cat([self.kv_a_layernorm(c_kv), self._rotate(k_pe.unsqueeze(1), cos, sin)[:, 0]], dim=-1)
        if self.indexer is not None:
            out = sparse_mla_attention(q, k, self.indexer(h, q_resid, cos, sin), self.attn, self.indexer)
        else:
            out = shared_sparse_mla_attention(q, k, self.attn, self.source_index)
        out = self.kv_b_proj.expand_output(out.view(tokens, self.num_heads, self.rank))
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


class DeepseekV32DecoderLayer(DeepseekDecoderLayer):
    def build_attention(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn
    ) -> nn.Module:
        return SparseMLAAttention(init, layer_idx, spec_fn)


class DeepseekV32Model(DeepseekModel):
    layer_class = DeepseekV32DecoderLayer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (-Exp): V3 with DeepSeek Sparse Attention. One rank only (the indexer is not split)."""

    attention_spec = staticmethod(v32_attention_spec)
    model_class = DeepseekV32Model
    supports_parallel = False
    unsplit_layers = "the sparse attention's indexer is not split over ranks"

    def __init__(self, init: ModelInit):
        check_v32_config(init.hf_config)
        super().__init__(init)

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        """The L MLA layers, then the indexers' key caches (layer_idx L + j for the j-th indexed layer's)."""
        return hf_config.num_hidden_layers + len(indexed_layers(hf_config))

    @classmethod
    def selection_spec(cls, hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """MLA's sparse latent spec: the backend must run latent rows and keep them where the gather reads."""
        check_v32_config(hf_config)
        return v32_attention_spec(hf_config, dtype, block_size, 0)


class GlmMoeDsaDecoderLayer(DeepseekDecoderLayer):
    def build_attention(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn
    ) -> nn.Module:
        return SparseMLAAttention(init, layer_idx, spec_fn, interleaved_index=True)


class GlmMoeDsaModel(DeepseekModel):
    layer_class = GlmMoeDsaDecoderLayer


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 (transformers' `glm_moe_dsa`): DeepSeek-V3.2's sparse attention with the indexer's rope in
    interleaved pairs, and indexers only on the "full" layers of `indexer_types`: a "shared" layer keeps
    no indexer cache and attends over the tokens the last full layer chose in the same step."""

    model_class = GlmMoeDsaModel
