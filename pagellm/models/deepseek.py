"""DeepSeek-V2 and DeepSeek-V3: Multi-head Latent Attention (MLA) in the weight-absorbed form, on Llama's
decoder skeleton (embedding, residual RMSNorms, gated MLP, output projection), as transformers'
`deepseek_v2` and `deepseek_v3` compute them.

MLA, per token (transformers' DeepseekV2Attention / DeepseekV3Attention):
- q: `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (low rank `q_lora_rank`), or one `q_proj` where the config
  has no q_lora_rank (V2-Lite); each head's qk_nope_head_dim features then its qk_rope_head_dim features
- kv: `kv_a_proj_with_mqa` gives the latent c_kv [kv_lora_rank], normalised by `kv_a_layernorm`, and one
  rotary key k_pe [qk_rope_head_dim] shared by every head; `kv_b_proj` would expand c_kv into each head's
  k_nope [qk_nope_head_dim] and v [v_head_dim]
- rotary on the rope features only (decoupled rope). DeepSeek lays them out in interleaved pairs (x0, x1),
  (x2, x3), ...: V2 always (complex multiplication), V3 where `rope_interleave` (the default). Both are
  rotated here by de-interleaving first (evens, then odds) and rotating halves, which is V3's output
  layout; V2 interleaves its result again, but q_pe and k_pe move alike, so every q.k is the same
- softmax scale (qk_nope + qk_rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 with a YaRN rope;
  YaRN's own attention factor scales cos/sin (transformers' yarn init, in `RotaryEmbedding`)

Weight absorption: k_nope_h . q_nope_h = c_kv . (W_UK_h^T q_nope_h), so the query's nope part is
multiplied into latent space once per token and head (`LatentUpProjection.absorb_query`), and attention is
MQA over the cache's one latent row per token, [c_kv, k_pe] (kv_lora_rank + qk_rope_head_dim), with V its
first kv_lora_rank elements (`AttentionSpec.latent_kv`); the latent output of each head is expanded by
W_UV_h afterwards (`expand_output`). Prefill and decode both run this form: the cache stays latent and
the attention backend does one thing. (The expanded form, attention over per-head K/V expanded from the
latents, does less work per prefill token on a wide model; vLLM switches to it for long prefills.)

The KV cache per token and layer is (kv_lora_rank + qk_rope_head_dim) elements, against num_heads x
(qk_nope + qk_rope + v_head_dim) for the same model with a K and V row per head: DeepSeek-V3 keeps 576 in
place of 40,960 (1/71). Under tensor parallelism each rank holds that whole latent cache: the latent
row is every head's, so it is not split (`MLAAttention`).

MLP per layer (`DeepseekDecoderLayer.build_mlp`): the dense gated MLP before `first_k_dense_replace` (and,
with `moe_layer_freq` f, on layers whose index f does not divide, as DeepSeek's own modelling code builds
them; transformers reads no moe_layer_freq, every released model has 1), a mixture of experts from there
on (`deepseek_moe_block`): `n_routed_experts` routed experts on the `FusedMoE` layer (the checkpoint's
per-expert `mlp.experts.{e}.gate_proj/up_proj/down_proj`), and `n_shared_experts` shared experts that every
token runs, one gated MLP of width n_shared_experts x moe_intermediate_size (`mlp.shared_experts`). The
router is float32 (weights and logits), as transformers keeps it; `deepseek_routing` reads its scoring
from the config. DeepSeek-V3 checkpoints carry the multi-token-prediction module as layer
`num_hidden_layers` (`num_nextn_predict_layers`); the model skips it, and speculative decoding's `mtp`
method loads it as a draft head (`spec_decode/mtp.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.core.platform import PackedLinear
from pagellm.models.base import ModelInit, rank_heads
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, is_sparse_layer
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SIGMOID, SOFTMAX, Routing
from pagellm.models.layers.linear import Linear, Shard
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.position_scale import scale_query
from pagellm.models.layers.rotary import apply_rotary, rope_parameters
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, SpecFn

STACKED = (
    ("fused_qkv_a_proj", "q_a_proj", 0),
    ("fused_qkv_a_proj", "q_proj", 0),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
"""q's first projection and the kv latent projection both read the hidden state: one matmul."""

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps."""


def yarn_mscale(factor: float, mscale: float) -> float:
    """transformers' `yarn_get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(hf_config: Any) -> float:
    """(qk_nope + qk_rope) ** -0.5, times mscale(factor, mscale_all_dim) squared under a scaled rope that
    states mscale_all_dim (transformers' `yarn_apply_mscale`)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def mla_attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    """MQA over the latent rows: every query head against one cached [c_kv, k_pe] row per token, V = c_kv."""
    rank = hf_config.kv_lora_rank
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=1,
        head_size=rank + hf_config.qk_rope_head_dim,
        dtype=dtype,
        block_size=block_size,
        scale=mla_softmax_scale(hf_config),
        v_head_size=rank,
        latent_kv=True,
    )


def interleaved_rope(hf_config: Any) -> bool:
    """Whether the rope features come in interleaved pairs: always in V2, in V3 where `rope_interleave` (its
    default) says so."""
    return hf_config.model_type == "deepseek_v2" or bool(getattr(hf_config, "rope_interleave", True))


RENORMALIZE_EPS = 1e-20
"""Added to the top k weights' sum before renormalising, in every DeepSeek-style router."""
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_routing(hf_config: Any) -> Routing:
    """The router of DeepSeek-V2 (softmax), DeepSeek-V3 and GLM-4.5 (sigmoid, "noaux_tc"), as transformers'
    DeepseekV2TopkRouter / DeepseekV3TopkRouter / Glm4MoeTopkRouter compute it:

    - V2, `topk_method` "greedy": softmax over every expert, the top k; "group_limited_greedy": only the
      experts of the `topk_group` groups (of `n_group`) with the best single score. The weights are the
      chosen softmax scores, times `routed_scaling_factor`. transformers ignores `norm_topk_prob` here;
      DeepSeek's own code (and vLLM) renormalises the k weights with it (k > 1) before scaling, and so
      does this (every released V2 model has it false, so the two agree on them).
    - V3 and GLM-4.5 (whatever their `topk_method` says: transformers reads none): sigmoid per expert; the
      choice adds `e_score_correction_bias` and is grouped (a group's score: its two best), the weights
      are the un-biased scores, renormalised with `norm_topk_prob`, times `routed_scaling_factor`."""
    c = hf_config
    common = dict(
        renormalize=bool(getattr(c, "norm_topk_prob", False)),
        scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
        renormalize_eps=RENORMALIZE_EPS,
    )
    if c.model_type != "deepseek_v2":
        groups = dict(num_groups=c.n_group or 1, topk_groups=c.topk_group or 1)
        return Routing(c.num_experts_per_tok, SIGMOID, **groups, **common)
    method = getattr(c, "topk_method", "greedy")
    if method not in V2_TOPK_METHODS:
        raise ConfigError(
            f"DeepSeek-V2 topk_method {method!r} is not supported; supported: {', '.join(V2_TOPK_METHODS)} "
            "(noaux_tc is DeepSeek-V3's: DeepseekV3ForCausalLM)"
        )
    groups = dict(num_groups=c.n_group, topk_groups=c.topk_group) if method == "group_limited_greedy" else {}
    common["renormalize"] &= c.num_experts_per_tok > 1  # DeepSeek's code: "if self.top_k > 1 and ..."
    return Routing(c.num_experts_per_tok, SOFTMAX, **groups, **common)


def deepseek_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts: from `first_k_dense_replace` on, every `moe_layer_freq`-th."""
    return (
        is_sparse_layer(hf_config, layer_idx)
        and layer_idx % (getattr(hf_config, "moe_layer_freq", 1) or 1) == 0
    )


def deepseek_moe_block(init: ModelInit) -> SparseMoeBlock:
    """Routed experts, a float32 router (with V3's and GLM-4.5's `e_score_correction_bias`) and the shared
    experts as one MLP of width n_shared_experts x moe_intermediate_size (reduced with the routed ones)."""
    c = init.hf_config
    routing = deepseek_routing(c)
    shared = getattr(c, "n_shared_experts", None) or 0
    return SparseMoeBlock(
        init,
        routing,
        c.moe_intermediate_size,
        router_dtype=torch.float32,
        correction_bias=routing.scoring == SIGMOID,
        shared_expert=LlamaMLP(init, shared * c.moe_intermediate_size, reduce=False) if shared else None,
    )


def adapt_moe_names(name: str) -> str:
    """DeepSeek's and GLM-4.5's `mlp.shared_experts` is the block's `shared_expert`."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: the checkpoint's [num_heads * (qk_nope + v_head_dim), kv_lora_rank] weight, never applied
    to the cache: each head's first qk_nope rows (W_UK) absorb into its query, its v_head_dim rows (W_UV)
    expand its latent output. A plain parameter, not a `Linear`, since both products read the weight per
    head (a platform's packed or a quantized layout would hide it). It is loaded laid out as the products
    read it (`_load`): every head's W_UK [qk_nope, rank], then every head's W_UV^T [rank, v_head_dim], so
    each batched product reads contiguous matrices (strided per-head slices of the checkpoint's layout had
    torch's bmm copy both, 2 MiB a layer and step at model D's sizes). Under tensor parallelism a rank holds
    only its `num_heads` heads' rows, from head `first_head` on (None: one rank, every head); both products
    read nothing else."""

    def __init__(
        self,
        num_heads: int,
        nope: int,
        v_dim: int,
        rank: int,
        dtype: torch.dtype,
        first_head: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.nope, self.v_dim, self.rank = num_heads, nope, v_dim, rank
        self.first_head = first_head
        self.weight = nn.Parameter(
            torch.empty(num_heads * (nope + v_dim), rank, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self._load
        self.split = num_heads * nope * rank  # where the W_UV^T part starts

    def narrow_checkpoint(self, attr: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's heads' rows of the checkpoint's `kv_b_proj.weight` (called by the loader)."""
        if self.first_head is None:
            return tensor
        rows = self.nope + self.v_dim
        return tensor.narrow(0, self.first_head * rows, self.num_heads * rows)

    def _load(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        """The checkpoint's rows (this rank's), laid out as the products read them."""
        if tensor.shape != param.shape:
            raise ConfigError(
                f"kv_b_proj.weight has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}; "
                "the config does not match the weights"
            )
        per_head = tensor.view(self.num_heads, self.nope + self.v_dim, self.rank)
        flat = param.data.view(-1)
        flat[: self.split].view(self.num_heads, self.nope, self.rank).copy_(per_head[:, : self.nope])
        w_uv_t = flat[self.split :].view(self.num_heads, self.rank, self.v_dim)
        w_uv_t.copy_(per_head[:, self.nope :].transpose(1, 2))

    def pack_per_head(self, pack: Callable[[torch.Tensor], PackedLinear | None]) -> None:
        """Hand both products' weights to the platform (`Platform.pack_per_head`: W_UK_h^T and W_UV_h, each
        [out, in] per head); where it packs both, keep only the packed ones and multiply with its matmul."""
        w_uk = self.weight.view(-1)[: self.split].view(self.num_heads, self.nope, self.rank)
        w_uv_t = self.weight.view(-1)[self.split :].view(self.num_heads, self.rank, self.v_dim)
        absorb, expand = pack(w_uk.transpose(1, 2)), pack(w_uv_t.transpose(1, 2))
        if absorb is None or expand is None:
            return
        self.register_buffer("packed_absorb", absorb.weight, persistent=False)
        self.register_buffer("packed_expand", expand.weight, persistent=False)
        self.absorb_matmul, self.expand_matmul = absorb.matmul, expand.matmul
        self.weight = None

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope] -> [T, H, kv_lora_rank]: q_nope_h W_UK_h."""
        if self.weight is None:
            return self.absorb_matmul(q_nope, self.packed_absorb, None)
        w_uk = self.weight.view(-1)[: self.split].view(self.num_heads, self.nope, self.rank)
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] -> [T, H, v_head_dim]: o_h W_UV_h^T."""
        if self.weight is None:
            return self.expand_matmul(latent, self.packed_expand, None)
        w_uv_t = self.weight.view(-1)[self.split :].view(self.num_heads, self.rank, self.v_dim)
        return torch.bmm(latent.transpose(0, 1), w_uv_t).transpose(0, 1)


class MLAAttention(nn.Module):
    """Tensor parallel as vLLM splits MLA: the query heads over the ranks (`q_proj` or `q_b_proj` column
    parallel by heads, `kv_b_proj` by its heads' rows, `o_proj` row parallel), while the latent path is
    replicated: `q_a_proj` and `q_a_layernorm`, `kv_a_proj_with_mqa` and `kv_a_layernorm` are whole on
    every rank, which computes and caches the same latent row (MQA's one KV head, not split: each rank
    holds the whole latent cache for its heads to attend over)."""

    def __init__(self, init: ModelInit, layer_idx: int, spec_fn: SpecFn, interleaved: bool):
        super().__init__()
        c = init.hf_config
        dtype, quant, tp = init.dtype, init.quant_method, init.parallel.tp
        spec = rank_heads(spec_fn(c, dtype, init.block_size, layer_idx), tp)
        self.num_heads = spec.num_heads  # this rank's
        split = tp.size > 1
        first_head = tp.rank * self.num_heads
        self.nope, self.rope, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        self.v_dim = c.v_head_dim
        q_size = self.num_heads * (self.nope + self.rope)
        q_rows = (first_head * (self.nope + self.rope), q_size)
        self.q_lora_rank = c.q_lora_rank
        self.q_in = self.q_lora_rank or q_size  # q's first projection: the low-rank q, or q itself
        bias = bool(getattr(c, "attention_bias", False))
        sizes = [self.q_in, self.rank + self.rope]
        # q_proj's rows split by heads; the latents (q_a_proj's, kv_a_proj_with_mqa's) whole on every rank
        a_shard = Shard(0, (q_rows, (0, sizes[1]))) if split and self.q_lora_rank is None else None
        self.fused_qkv_a_proj = Linear(c.hidden_size, sum(sizes), bias, dtype, quant, sizes, a_shard)
        if bias and self.q_lora_rank is None:  # q_proj has no bias: its rows of the fused one stay zero
            self.fused_qkv_a_proj.bias.data[: self.q_in].zero_()
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            b_shard = Shard(0, (q_rows,)) if split else None
            self.q_b_proj = Linear(self.q_lora_rank, q_size, False, dtype, quant, shard=b_shard)
        else:
            self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(
            self.num_heads, self.nope, self.v_dim, self.rank, dtype, first_head if split else None
        )
        o_width = self.num_heads * self.v_dim
        o_shard = Shard(1, ((first_head * self.v_dim, o_width),)) if split else None
        self.o_proj = Linear(o_width, c.hidden_size, bias, dtype, quant, shard=o_shard, reduce=tp)
        self.interleaved = interleaved
        self.attn = Attention(init, spec, layer_idx)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`q_scale` [T]: each token's query scale (Mistral 4's position scaling), on the whole query after
        rotary as transformers applies it; linear, so it may scale the absorbed query."""
        tokens = h.shape[0]
        q, latent = self.fused_qkv_a_proj(h).split([self.q_in, self.rank + self.rope], dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        c_kv, k_pe = latent.split([self.rank, self.rope], dim=-1)
        q = torch.cat([self.kv_b_proj.absorb_query(q_nope), self._rotate(q_pe, cos, sin)], dim=-1)
        if q_scale is not None:
            q = scale_query(q, q_scale)
        k = torch.cat([self.kv_a_layernorm(c_kv), self._rotate(k_pe.unsqueeze(1), cos, sin)[:, 0]], dim=-1)
        out = self.attn(q.reshape(tokens, -1), k, k[:, : self.rank])  # V: the latent c_kv, k's prefix
        out = self.kv_b_proj.expand_output(out.view(tokens, self.num_heads, self.rank))
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with MLA (q/k/v bias and q/k norms are not DeepSeek's); its MLP dense or the
    mixture of experts."""

    def build_attention(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn
    ) -> nn.Module:
        return MLAAttention(init, layer_idx, spec_fn, interleaved_rope(init.hf_config))

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: the dense gated MLP, or the mixture of experts on the sparse layers."""
        if not deepseek_sparse_layer(init.hf_config, layer_idx):
            return LlamaMLP(init)
        return deepseek_moe_block(init)


class DeepseekModel(LlamaModel):
    layer_class = DeepseekDecoderLayer


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite, without q_lora_rank). Tensor parallel by attention heads (`MLAAttention`),
    the experts by width or whole (--enable-expert-parallel), the shared experts and dense MLPs by width;
    pipeline parallel by layers, as Llama."""

    attention_spec = staticmethod(mla_attention_spec)
    float_modules = ("kv_b_proj",)  # a `LatentUpProjection`: a plain weight, read per head
    model_class = DeepseekModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= len(self.model.layers):
            return None  # V3's multi-token-prediction layer(s): not a decoder layer, no drafts from it
        return super()._adapt(adapt_moe_names(name), tensor)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and R1): V2's attention, with `rope_interleave` from the config."""
