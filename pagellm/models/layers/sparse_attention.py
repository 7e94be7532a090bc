"""DeepSeek Sparse Attention (DSA): the lightning indexer in front of MLA (DeepSeek-V3.2, transformers'
`deepseek_v32`), which picks for each query token the `index_topk` earlier tokens its attention reads.

The indexer (`Indexer`, transformers' DeepseekV32Indexer) has its own small projections: a query of
`index_n_heads` heads of `index_head_dim` from MLA's low-rank query (`wq_b` of q_a_layernorm(q_a_proj(x))),
one key of `index_head_dim` per token (`wk`, then a LayerNorm `k_norm`), the first `qk_rope_head_dim`
features of both rotated in halves (not in MLA's interleaved pairs), and a weight per head and token
(`weights_proj`, float32). A query's score for an earlier token t is

    sum_h weights[h] * n_heads ** -0.5 * relu(q_h . k_t * index_head_dim ** -0.5)

and the query reads the `index_topk` best of the tokens at or before its position (every one of them while
there are no more than index_topk). The Hadamard rotation and fp8 scoring of DeepSeek's own kernels are
left out, as transformers leaves them out: the rotation keeps every dot product, fp8 only rounds.

Why the indexer's keys are a KV-cache group: a key is computed once from its token's hidden state and read
by every later query, so it is cached like K and V, one row of `index_head_dim` per token and layer
(`indexer_cache_spec`, a layer index of its own after the model's attention layers). Its group sits beside
the latent (MLA) group in the KV cache manager, so its blocks are allocated, prefix-cached, freed and
preempted with the request's others (core/kv_cache_spec.py); the two groups' block tables differ, and each
is read through its own.

Attention reads only the selected tokens: `sparse_mla_attention` stores the step's latent rows and indexer
keys, scores each query against its request's indexer keys (the indexer reads every earlier key: it is
small, index_head_dim elements per token against MLA's kv_lora_rank + qk_rope_head_dim), takes the top k,
turns the chosen positions into cache slots through the latent group's block table and gathers only those
latent rows, then runs the absorbed MLA softmax over them. The gather needs the cache as slot-major rows,
TORCH_SDPA's layout (`AttentionBackend.supports_index_topk`); other backends are refused at start-up.
The work is one custom op per layer (`pagellm::sparse_mla_attention`) so that compiled graphs keep it
opaque, as `pagellm::attention`. GLM-5's "shared" layers run no indexer: they read the choice the last
full layer made in the same step (`_SELECTIONS`, checked against the step's batch), through their own op
(`pagellm::shared_sparse_mla_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.attention_backends._base import store_kv
from pagellm.core.attention import AttentionSpec
from pagellm.core.sparse_kernels import ROW_DTYPES, SparseAttentionKernels
from pagellm.models.context import ForwardContext, ModelInit, get_forward_context
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.rotary import apply_rotary

INDEX_NORM_EPS = 1e-6
"""transformers' indexer LayerNorm eps (not the config's rms_norm_eps)."""

_KERNELS = SparseAttentionKernels()
"""The platform's kernels for the two passes over the cache (`use_kernels`); None fields: the references."""


def use_kernels(kernels: SparseAttentionKernels) -> None:
    """Run the passes on `kernels` from now on (the model runner's platform's, set when it is built)."""
    global _KERNELS
    _KERNELS = kernels


def indexer_cache_spec(hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
    """The indexer's key cache: one row of index_head_dim per token (a latent-style spec: one row, no V),
    marked with index_topk so that only a backend whose rows the gather reads is selected."""
    return AttentionSpec(
        num_heads=1,
        num_kv_heads=1,
        head_size=hf_config.index_head_dim,
        dtype=dtype,
        block_size=block_size,
        latent_kv=True,
        index_topk=hf_config.index_topk,
    )


@dataclass(frozen=True)
class Selection:
    """One request's choice: `positions` [Q, k] of the tokens each query reads, `valid` [Q, k] False where a
    query has fewer than k tokens to read (its padding), `scores` [Q, k] the indexer's scores of them."""

    positions: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor


def context_slots(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of a request's positions 0..num_tokens-1 through its block table row: each block's
    first slot plus 0..block_size-1 (two ops over the blocks, where each position's block and offset over
    16k positions took five elementwise passes, ~0.16 ms a layer and step)."""
    blocks = -(-num_tokens // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[:blocks].long()[:, None] * block_size + offsets).reshape(-1)[:num_tokens]


def step_context_slots(
    ctx: ForwardContext, layer_idx: int, request: int, num_tokens: int, block_size: int
) -> torch.Tensor:
    """`context_slots` of `request` through the block tables of layer `layer_idx`'s KV-cache group, worked
    out once a step (`ForwardContext.memo`): the group's layers share its tables (the indexer's and MLA's
    groups, each read by every sparse layer)."""
    batch = ctx.metadata_of(layer_idx).batch
    key = ("sparse context slots", id(batch.block_tables), request, num_tokens)
    if key not in ctx.memo:
        ctx.memo[key] = context_slots(batch.block_tables[request], num_tokens, block_size)
    return ctx.memo[key]


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """[Q, H, D] queries, [S, D] keys, [Q, H] float32 head weights (already times n_heads ** -0.5) ->
    [Q, S] float32: sum_h weights[h] * relu(q_h . k * scale), as transformers sums it (a matmul over heads)."""
    dots = torch.matmul(q.float(), keys.float().t())  # [Q, H, S]
    dots = dots.mul_(scale).relu_()  # in place: [Q, H, S] is the indexer's largest tensor
    return torch.matmul(weights.float().unsqueeze(1), dots).squeeze(1)


def select_topk(scores: torch.Tensor, query_positions: torch.Tensor, topk: int) -> Selection:
    """The top `topk` of each query's scores [Q, S] among positions <= its own (`query_positions` [Q]), in
    no set order: the same tokens as a sorted top k (the order only changes the attention's float sums),
    ~0.1 ms a layer faster at 16k keys (model D, Zen 4)."""
    num_keys = scores.shape[1]
    if num_keys - 1 > int(query_positions[0]):  # a prefill chunk: later keys hidden (a decode sees them all)
        keys = torch.arange(num_keys, device=scores.device)
        scores = scores.masked_fill(keys[None, :] > query_positions[:, None], float("-inf"))
    best, positions = scores.topk(min(topk, num_keys), dim=-1, sorted=False)
    return Selection(positions, positions <= query_positions[:, None], best)


def attend_selected(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float, v_size: int
) -> torch.Tensor:
    """Absorbed MLA over each query's gathered latent rows: q [Q, H, R'], rows [Q, k, R'] (V: their first
    v_size elements), valid [Q, k] -> [Q, H, v_size]."""
    scores = torch.einsum("qhd,qkd->qhk", q.float(), rows.float()).mul_(scale)
    if not bool(valid.all()):  # queries with fewer than k tokens before them
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("qhk,qkv->qhv", probs, rows[..., :v_size].float()).to(q.dtype)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """A latent-style cache [1, blocks, block_size, 1, row] as slot-major rows [blocks * block_size, row]."""
    return cache[0].reshape(-1, cache.shape[-1])


@dataclass(frozen=True)
class SparseParams:
    """A layer's constants: MLA's softmax scale and V width, the indexer's score scale and top k."""

    scale: float
    v_size: int
    index_scale: float
    topk: int


def sparse_mla_forward(
    q: torch.Tensor,
    latent: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    layers: tuple[int, int],
    params: SparseParams,
    ctx: ForwardContext,
) -> torch.Tensor:
    """The step of one sparse MLA layer: store the latent rows [T, R'] and indexer keys [T, D] at their
    slots (layers: the MLA layer's and its indexer cache's layer_idx), select each query's top k, attend over
    their latent rows alone. q [T, H, R'], index_q [T, Hi, D], index_weights [T, Hi] -> [T, H, v_size]."""
    mla_meta, index_meta = ctx.metadata_of(layers[0]), ctx.metadata_of(layers[1])
    mla_cache, index_cache = ctx.kv_caches[layers[0]], ctx.kv_caches[layers[1]]
    store_kv(mla_cache, latent.unsqueeze(1), None, mla_meta)
    store_kv(index_cache, index_k.unsqueeze(1), None, index_meta)
    index_rows, block_size = _rows(index_cache), index_cache.shape[2]
    starts = mla_meta.batch.query_start_loc_cpu.tolist()
    chosen: list[Selection | None] = []
    for r, seq_len in enumerate(mla_meta.batch.seq_lens_cpu.tolist()):
        first, end = starts[r], starts[r + 1]
        if end == first:
            chosen.append(None)
            continue
        positions = torch.arange(seq_len - (end - first), seq_len, device=q.device)
        slots = step_context_slots(ctx, layers[1], r, seq_len, block_size)
        kernel = _KERNELS.index_scores if index_rows.dtype in ROW_DTYPES else None
        keys = index_rows.index_select(0, slots) if kernel is None else None
        parts = []
        for a, b in _query_slices(end - first, index_q.shape[1] * seq_len):  # [Q, Hi, S] floats at most
            iq, weights = index_q[first + a : first + b], index_weights[first + a : first + b]
            if kernel is None:
                scores = index_scores(iq, keys, weights, params.index_scale)
            else:
                scores = kernel(
                    iq.contiguous(),
                    index_rows,
                    slots,
                    weights.float().contiguous(),
                    params.index_scale,
                )
            parts.append(select_topk(scores, positions[a:b], params.topk))
        chosen.append(_joined(parts))
    _SELECTIONS[layers[0]] = (_step_key(mla_meta.batch), chosen)
    return attend_chosen(q, mla_cache, layers[0], chosen, params, ctx)


_SELECTIONS: dict[int, tuple[tuple, list[Selection | None]]] = {}
"""The step's selections of each full layer (by its MLA layer_idx), for the layers that share them (GLM-5's
"shared" layers read the last full layer's): the step's query starts and lengths beside each request's
choice, which a sharing layer checks, so a choice is never read by another step."""


def _step_key(batch: Any) -> tuple:
    return (tuple(batch.query_start_loc_cpu.tolist()), tuple(batch.seq_lens_cpu.tolist()))


def attend_chosen(
    q: torch.Tensor,
    mla_cache: torch.Tensor,
    mla_layer: int,
    chosen: list[Selection | None],
    params: SparseParams,
    ctx: ForwardContext,
) -> torch.Tensor:
    """Each request's chosen positions -> slots through the latent group's block table -> those latent rows
    alone -> attention (q [T, H, R'] -> [T, H, v_size])."""
    batch, rows_of = ctx.metadata_of(mla_layer).batch, _rows(mla_cache)
    kernel = _KERNELS.attend_rows if rows_of.dtype in ROW_DTYPES else None
    block_size, starts = mla_cache.shape[2], batch.query_start_loc_cpu.tolist()
    seq_lens = batch.seq_lens_cpu.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], params.v_size)
    for r, choice in enumerate(chosen):
        if choice is None:
            continue
        first, end = starts[r], starts[r + 1]
        context = step_context_slots(ctx, mla_layer, r, seq_lens[r], block_size)
        for a, b in _query_slices(end - first, choice.positions.shape[1] * rows_of.shape[1]):
            slots = context[choice.positions[a:b]]  # the chosen only
            if kernel is not None:
                part = kernel(
                    q[first + a : first + b].contiguous(),
                    rows_of,
                    slots.contiguous(),
                    choice.valid[a:b].contiguous(),
                    params.scale,
                    params.v_size,
                )
                out[first + a : first + b] = part.to(q.dtype)
                continue
            rows = rows_of.index_select(0, slots.reshape(-1)).view(*slots.shape, -1).to(q.dtype)
            out[first + a : first + b] = attend_selected(
                q[first + a : first + b], rows, choice.valid[a:b], params.scale, params.v_size
            )
    return out


SLICE_ELEMENTS = 1 << 24
"""Most elements a query slice's largest tensor holds (the indexer's [Q, Hi, S] float32 scores, the gathered
latent rows [Q, k, R']): 64 MiB of float32, so a long prefill chunk over a long context runs in slices
instead of asking for gigabytes (2,048 queries over 16k keys and 64 indexer heads: 8 GiB at once)."""


def _query_slices(num_queries: int, per_query: int) -> list[tuple[int, int]]:
    """[a, b) ranges of queries, each holding at most SLICE_ELEMENTS of `per_query` elements (one at least)."""
    size = max(1, SLICE_ELEMENTS // max(1, per_query))
    return [(a, min(a + size, num_queries)) for a in range(0, num_queries, size)]


def _joined(parts: list[Selection]) -> Selection:
    """The selections of consecutive query slices as one."""
    if len(parts) == 1:
        return parts[0]
    return Selection(
        torch.cat([p.positions for p in parts]),
        torch.cat([p.valid for p in parts]),
        torch.cat([p.scores for p in parts]),
    )


def shared_sparse_mla_forward(
    q: torch.Tensor, latent: torch.Tensor, layers: tuple[int, int], params: SparseParams, ctx: ForwardContext
) -> torch.Tensor:
    """A layer without an indexer (layers: its own layer_idx and the full layer's whose choice it reads):
    store its latent rows, attend over the tokens that layer chose in this step."""
    mla_meta, mla_cache = ctx.metadata_of(layers[0]), ctx.kv_caches[layers[0]]
    store_kv(mla_cache, latent.unsqueeze(1), None, mla_meta)
    key, chosen = _SELECTIONS.get(layers[1], ((), []))
    if key != _step_key(mla_meta.batch):
        raise RuntimeError(
            f"attention layer {layers[0]} shares layer {layers[1]}'s selection, not made this step"
        )
    return attend_chosen(q, mla_cache, layers[0], chosen, params, ctx)


@torch.library.custom_op("pagellm::shared_sparse_mla_attention", mutates_args=())
def _shared_sparse_mla_op(
    q: torch.Tensor,
    latent: torch.Tensor,
    layer_index: torch.Tensor,
    source_index: torch.Tensor,
    scale: float,
    v_size: int,
) -> torch.Tensor:
    """`shared_sparse_mla_forward` in a compiled graph (the layers as tensors, as the full layers' op)."""
    params = SparseParams(scale, v_size, 1.0, 0)
    layers = (int(layer_index), int(source_index))
    return shared_sparse_mla_forward(q, latent, layers, params, get_forward_context())


@_shared_sparse_mla_op.register_fake
def _(
    q: torch.Tensor,
    latent: torch.Tensor,
    layer_index: torch.Tensor,
    source_index: torch.Tensor,
    scale: float,
    v_size: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_size)


@torch.library.custom_op("pagellm::sparse_mla_attention", mutates_args=())
def _sparse_mla_op(
    q: torch.Tensor,
    latent: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    layer_index: torch.Tensor,
    index_layer: torch.Tensor,
    scale: float,
    v_size: int,
    index_scale: float,
    topk: int,
) -> torch.Tensor:
    """`sparse_mla_forward` in a compiled graph: the layers are tensors (as `pagellm::attention`'s), so one
    compiled layer serves every layer; it writes both caches, which are not arguments."""
    params = SparseParams(scale, v_size, index_scale, topk)
    layers = (int(layer_index), int(index_layer))
    ctx = get_forward_context()
    return sparse_mla_forward(q, latent, index_q, index_k, index_weights, layers, params, ctx)


@_sparse_mla_op.register_fake
def _(
    q: torch.Tensor,
    latent: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    layer_index: torch.Tensor,
    index_layer: torch.Tensor,
    scale: float,
    v_size: int,
    index_scale: float,
    topk: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_size)


class Indexer(nn.Module):
    """The lightning indexer of one layer: its projections and its key cache (an `Attention` layer only
    for the cache the runner allocates and the metadata of its KV-cache group; its backend never runs)."""

    def __init__(self, init: ModelInit, cache_layer_idx: int, interleaved: bool = False):
        """`interleaved`: the rope features come in pairs (x0, x1), (x2, x3)... (GLM-5's indexer), rotated
        here as halves after de-interleaving q and k alike, which keeps every q.k (as MLA's `_rotate`)."""
        super().__init__()
        c = init.hf_config
        self.n_heads, self.head_dim, self.rope = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        self.topk = c.index_topk
        self.interleaved = interleaved
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, False, init.dtype, init.quant_method)
        self.wk = Linear(c.hidden_size, self.head_dim, False, init.dtype, init.quant_method)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS, dtype=init.dtype)
        # float32, as transformers keeps it (`_keep_in_fp32_modules`); a torch Linear, which no platform packs
        self.weights_proj = nn.Linear(c.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        self.weights_proj.requires_grad_(False)
        self.k_norm.requires_grad_(False)
        self.scale = self.head_dim**-0.5
        self.cache = Attention(init, indexer_cache_spec(c, init.dtype, init.block_size), cache_layer_idx)

    def forward(
        self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, hidden], q_resid [T, q_lora_rank] -> the rotated queries [T, Hi, D], keys [T, D] and the
        head weights [T, Hi] (float32, times n_heads ** -0.5)."""
        tokens = h.shape[0]
        q = apply_rotary(self._halves(self.wq_b(q_resid).view(tokens, self.n_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self._halves(self.k_norm(self.wk(h)).unsqueeze(1)), cos, sin)[:, 0]
        weights = self.weights_proj(h.float()) * self.n_heads**-0.5
        return q, k, weights

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """The rope features' pairs (x0, x1), (x2, x3)... as halves (x0, x2...), (x1, x3...) where interleaved."""
        if not self.interleaved:
            return x
        rope = x[..., : self.rope]
        return torch.cat([rope[..., 0::2], rope[..., 1::2], x[..., self.rope :]], dim=-1)


def sparse_mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    attn: Attention,
    indexer: Indexer,
) -> torch.Tensor:
    """MLA layer `attn` over the tokens `indexer` selects: q [T, H, R'] (absorbed), latent rows [T, R'],
    index = the indexer's (queries, keys, weights) -> [T, H, v_size]. Eager: straight to
    `sparse_mla_forward`; compiling: through the opaque op."""
    s = attn.spec
    params = SparseParams(s.softmax_scale, s.v_size, indexer.scale, indexer.topk)
    if torch.compiler.is_compiling():
        return torch.ops.pagellm.sparse_mla_attention(
            q,
            latent,
            *index,
            attn.layer_index,
            indexer.cache.layer_index,
            params.scale,
            params.v_size,
            params.index_scale,
            params.topk,
        )
    layers = (attn.layer_idx, indexer.cache.layer_idx)
    return sparse_mla_forward(q, latent, *index, layers, params, get_forward_context())


def shared_sparse_mla_attention(
    q: torch.Tensor, latent: torch.Tensor, attn: Attention, source_index: torch.Tensor
) -> torch.Tensor:
    """MLA layer `attn` over the tokens the full layer at `source_index` (an earlier MLA layer's layer_idx,
    a one-element host tensor, as `Attention.layer_index`) chose in this step."""
    s = attn.spec
    if torch.compiler.is_compiling():
        return torch.ops.pagellm.shared_sparse_mla_attention(
            q, latent, attn.layer_index, source_index, s.softmax_scale, s.v_size
        )
    params = SparseParams(s.softmax_scale, s.v_size, 1.0, 0)
    layers = (attn.layer_idx, int(source_index))
    return shared_sparse_mla_forward(q, latent, layers, params, get_forward_context())
