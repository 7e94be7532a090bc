"""The Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral, SmolLM2, Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm). One decoder, parametrised by the config and two class-level switches.

q/k/v and gate/up are fused into one matmul each; checkpoint tensors are loaded into their slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.native_decode import DenseDecoder, DenseLayer, Experts, Projection
from pagellm.distributed import Group
from pagellm.models.base import CausalLM, ModelInit, head_size, rank_heads, stage_layers
from pagellm.models.layers.activation import GatedActivation
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear, Shard
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding, apply_rotary
from pagellm.models.loader import copy_weights

STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def layer_sliding_window(hf_config, layer_idx: int) -> int | None:
    """Mistral: `sliding_window` for every layer; Qwen2/3: only layers whose `layer_types` say so."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None)


def attention_spec(hf_config, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
    return AttentionSpec(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_size=head_size(hf_config),
        dtype=dtype,
        block_size=block_size,
        sliding_window=layer_sliding_window(hf_config, layer_idx),
    )


SpecFn = Callable[[object, torch.dtype, int, int], AttentionSpec]
"""A model class's `attention_spec`: the layers build their attention with their class's own."""


class LlamaAttention(nn.Module):
    """q/k/v column parallel by heads (a KV head replicated on several ranks when there are fewer KV heads
    than ranks), o_proj row parallel."""

    o_bias: bool | None = None
    """Bias on o_proj; None: the config's `attention_bias` (GLM-4.5 has q/k/v biases but none on o)."""
    norm_class: type[nn.Module] = RMSNorm
    """The per-head q/k norms' class (Gemma's scales by 1 + w)."""

    def __init__(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn = attention_spec
    ):
        super().__init__()
        c = init.hf_config
        tp = init.parallel.tp
        full = spec_fn(c, init.dtype, init.block_size, layer_idx)
        spec = rank_heads(full, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        kv_head = tp.rank * full.num_kv_heads // tp.size  # this rank's first KV head
        kv = (kv_head * self.head_dim, self.kv_size)
        qkv_shard = Shard(0, ((tp.rank * self.q_size, self.q_size), kv, kv)) if tp.size > 1 else None
        self.qkv_proj = Linear(
            c.hidden_size, sum(sizes), qkv_bias, init.dtype, init.quant_method, sizes, qkv_shard
        )
        o_bias = self.o_bias if self.o_bias is not None else getattr(c, "attention_bias", False)
        o_shard = Shard(1, ((tp.rank * self.q_size, self.q_size),)) if tp.size > 1 else None
        self.o_proj = Linear(
            self.q_size, c.hidden_size, o_bias, init.dtype, init.quant_method, shard=o_shard, reduce=tp
        )
        self.q_norm = self.norm_class(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
        self.k_norm = self.norm_class(self.head_dim, c.rms_norm_eps, init.dtype) if qk_norm else None
        self.attn = Attention(init, spec, layer_idx)

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """cos/sin None: a layer without rotary (SmolLM3's NoPE layers)."""
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """gate/up column parallel, down row parallel. `intermediate_size`: another width than the config's
    (a mixture-of-experts model's shared expert or dense layers); `reduce` False: leave each rank's partial
    sum for the caller to add up (a shared expert, reduced with the routed experts)."""

    activation_field = "hidden_act"
    """The config field naming the gated activation (Gemma's: `hidden_activation`)."""

    def __init__(self, init: ModelInit, intermediate_size: int | None = None, reduce: bool = True):
        super().__init__()
        c = init.hf_config
        tp = init.parallel.tp
        bias = getattr(c, "mlp_bias", False)
        size = (intermediate_size or c.intermediate_size) // tp.size
        part = (tp.rank * size, size)
        self.gate_up_proj = Linear(
            c.hidden_size,
            2 * size,
            bias,
            init.dtype,
            init.quant_method,
            [size, size],
            Shard(0, (part, part)) if tp.size > 1 else None,
        )
        self.act = GatedActivation(getattr(c, self.activation_field))
        self.down_proj = Linear(
            size,
            c.hidden_size,
            bias,
            init.dtype,
            init.quant_method,
            shard=Shard(1, (part,)) if tp.size > 1 else None,
            reduce=tp if reduce else None,
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn = attention_spec
    ):
        super().__init__()
        c = init.hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.self_attn = self.build_attention(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mlp = self.build_mlp(init, layer_idx)

    def build_attention(
        self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn
    ) -> nn.Module:
        """The layer's attention (`attention_class`; DeepSeek's latent attention takes other arguments)."""
        return self.attention_class(init, layer_idx, qkv_bias, qk_norm, spec_fn)

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        """The layer's MLP: a mixture-of-experts family returns its expert block on its sparse layers."""
        return LlamaMLP(init)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(h, residual)
        h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """With pipeline parallelism a stage builds only its own layers (the others are empty placeholders,
    so parameter names stay the checkpoint's); the first stage embeds, the last normalises and hands the
    final hidden states back to the first, which holds the output projection.

    A layer takes and returns (h, residual), the residual stream being h + residual (residual None before
    the first layer). Subclasses (other families) change `layer_class`, `norm_class`, `embed` and the
    rotary embeddings (`init_rope`, `rope`)."""

    layer_class: type[nn.Module] = LlamaDecoderLayer
    norm_class: type[nn.Module] = RMSNorm
    """The final norm's class."""
    eps_field = "rms_norm_eps"
    """The config field holding the final norm's epsilon (LayerNorm families: StarCoder2's `norm_epsilon`)."""

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn = attention_spec):
        super().__init__()
        c = init.hf_config
        self.pp: Group = init.parallel.pp
        self.own = stage_layers(c.num_hidden_layers, self.pp)
        first, last = self.pp.rank == 0, self.pp.rank == self.pp.size - 1
        self.embed_tokens = (
            Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp) if first else None
        )
        self.init_rope(c)
        self.layers = nn.ModuleList(
            self.layer_class(init, i, qkv_bias, qk_norm, spec_fn) if i in self.own else nn.Identity()
            for i in range(c.num_hidden_layers)
        )
        self.norm = self.norm_class(c.hidden_size, getattr(c, self.eps_field), init.dtype) if last else None
        self.hidden_size, self.dtype = c.hidden_size, init.dtype

    def init_rope(self, hf_config) -> None:
        """The rotary embedding, and `layer_rope`: per layer, the index into `rope`'s list of its (cos, sin)."""
        self.rotary_emb = RotaryEmbedding(hf_config)
        self.layer_rope = [0] * hf_config.num_hidden_layers

    def rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of `positions` for each rotary embedding (one, unless a family has one per layer type)."""
        return [self.rotary_emb.cos_sin(positions)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.rope(positions)
        pp = self.pp
        if pp.rank == 0:
            h, residual = self.embed(input_ids), None
        else:
            h, residual = self._receive(input_ids, pp.rank - 1), self._receive(input_ids, pp.rank - 1)
        for i in self.own:
            h, residual = self.layers[i](h, residual, *rope[self.layer_rope[i]])
        if pp.rank < pp.size - 1:
            pp.send(h, pp.rank + 1)
            pp.send(residual, pp.rank + 1)
            return self._receive(input_ids, pp.size - 1) if pp.rank == 0 else h
        h = self.norm.add_and_norm(h, residual)[0]
        if pp.size > 1:
            pp.send(h, 0)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _receive(self, input_ids: torch.Tensor, source: int) -> torch.Tensor:
        buffer = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=input_ids.device)
        return self.pp.recv(buffer, source)


class LlamaForCausalLM(CausalLM):
    tied_by_default = False
    """Whether the output projection is the token embedding where the config does not say."""
    qkv_bias: bool | None = None
    """Bias on q/k/v projections; None: the config's `attention_bias`."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before rotary (Qwen3)."""
    attention_spec = staticmethod(attention_spec)
    supports_parallel = True
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else getattr(c, "attention_bias", False)
        self.model = self.model_class(init, qkv_bias, self.qk_norm, self.attention_spec)
        self.tp = init.parallel.tp
        self.vocab_size = c.vocab_size
        self.hidden_act = getattr(c, "hidden_act", "silu")
        self.tied = bool(getattr(c, "tie_word_embeddings", self.tied_by_default))
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
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]  # each rank's rows of the vocab

    def dense_decoder(self) -> DenseDecoder | str:
        """The plain decoder of Llama, Mistral, SmolLM2, Qwen2 and Qwen3 (`describe_decoder`); subclasses
        that change a part (other families) are not it."""
        if type(self) not in PLAIN_DECODERS:
            return f"{type(self).__name__} changes the Llama decoder"
        return describe_decoder(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, weights, STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
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


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window (from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


PLAIN_DECODERS = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
"""The classes whose model is exactly the decoder above (`LlamaForCausalLM.dense_decoder`)."""


ExpertsOf = Callable[[nn.Module], Experts | str]
"""A family's reader of a layer's expert block (`Experts`, or why the step cannot run it)."""


def describe_decoder(lm: LlamaForCausalLM, experts_of: ExpertsOf | None = None) -> DenseDecoder | str:
    """`lm` as a `DenseDecoder` (core/native_decode.py): unsplit, one rotary embedding over whole heads that
    does not depend on the sequence's length, RMSNorms, linears plain, packed or in blocks a native kernel
    reads in place; a layer's MLP a `LlamaMLP` or, with `experts_of`, what it reads (Qwen3-MoE)."""
    m = lm.model
    if lm.tp.size > 1 or m.pp.size > 1:
        return "the model is split across ranks"
    rope = m.rotary_emb
    if type(rope) is not RotaryEmbedding or rope.by_length or hasattr(rope, "mrope_axes"):
        return "its rotary embedding depends on the sequence's length or has several axes"
    attn0 = m.layers[0].self_attn
    if rope.rotary_dim != attn0.head_dim or rope.inv_freq.dim() != 1 or any(m.layer_rope):
        return "its rotary embedding covers part of each head or differs between layers"
    embed = m.embed_tokens
    if (embed.lookup is not None and embed.block_type is None) or embed.group is not None:
        return "its token embedding is packed or split"
    layers = []
    for layer in m.layers:
        described = _describe_layer(layer, m.norm.eps, experts_of)
        if isinstance(described, str):
            return described
        layers.append(described)
    dense = [layer.mlp for layer in m.layers if type(layer.mlp) is LlamaMLP]
    return DenseDecoder(
        embedding=embed.packed_table if embed.lookup is not None else embed.weight,
        embedding_type=embed.block_type if embed.lookup is not None else None,
        dtype=m.dtype,
        final_norm=m.norm.weight,
        inv_freq=rope.inv_freq,
        rope_scaling=rope.scaling,
        eps=m.norm.eps,
        hidden_size=m.hidden_size,
        num_heads=attn0.num_heads,
        num_kv_heads=attn0.num_kv_heads,
        head_size=attn0.head_dim,
        intermediate_size=dense[0].gate_up_proj.out_features // 2 if dense else 0,
        activation=lm.hidden_act,
        layers=layers,
    )


def _describe_layer(layer: nn.Module, eps: float, experts_of: ExpertsOf | None) -> DenseLayer | str:
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(layer, LlamaDecoderLayer) or type(attn) is not LlamaAttention:
        return "a layer differs from the Llama decoder's"
    experts = None
    if type(mlp) is not LlamaMLP:
        experts = experts_of(mlp) if experts_of is not None else "a layer's MLP differs from Llama's"
        if isinstance(experts, str):
            return experts
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
    if any(type(n) is not RMSNorm or n.eps != eps for n in norms):
        return "its norms differ from RMSNorm's"
    linears = [attn.qkv_proj, attn.o_proj]
    linears += [mlp.gate_up_proj, mlp.down_proj] if experts is None else [mlp.gate]
    if any(x.lora is not None or x.reduce is not None for x in linears):
        return "its linear layers carry LoRA or are split"
    if any(x.quant_method is not None and x.quant_method.native_blocks(x) is None for x in linears):
        return "its linear layers are quantized in a format no native kernel reads in place"
    mlps = (
        (None, None)
        if experts is not None
        else (projection_of(mlp.gate_up_proj), projection_of(mlp.down_proj))
    )
    return DenseLayer(
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        projection_of(attn.qkv_proj),
        projection_of(attn.o_proj),
        *mlps,
        q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
        k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
        experts=experts,
    )


def projection_of(linear: Linear) -> Projection:
    """The linear layer as loaded, for a `DenseDecoder`."""
    if linear.quant_method is not None:
        blocks = linear.quant_method.native_blocks(linear)
        return Projection(None, None, linear.bias, linear.out_features, linear.in_features, blocks)
    packed = linear.packed_matmul is not None
    weight = linear.packed_weight if packed else linear.weight
    matmul = linear.packed_matmul if packed else None
    return Projection(weight, matmul, linear.bias, linear.out_features, linear.in_features)
