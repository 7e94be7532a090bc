"""DeepSeek-V4's attention over a paged cache: a sliding window of the layer's own keys, plus pooled rows
that each stand for `compress_rate` tokens (transformers' `deepseek_v4`: DeepseekV4Attention with its
DeepseekV4HCACompressor or DeepseekV4CSACompressor and DeepseekV4Indexer).

Three layer kinds (`layer_types`):

- sliding: each query reads the `sliding_window` most recent keys (itself included). K = V: one row of
  head_dim per token (a single KV head), rotated; the output's rope part is rotated back by the query's
  position afterwards (the model does that).
- heavily compressed (HCA): beside the window, one pooled row per finished window of m tokens: the tokens'
  `kv_proj` rows weighted by a softmax over the window of their `gate_proj` rows plus a learnt bias per
  place in the window, RMS-normalised, rotated at the window's first position. A query at position t reads
  pooled row w once the window is complete, w < (t + 1) // m.
- compressed sparse (CSA): pooled rows of windows that overlap by half: row w pools the second half of the
  projections (2 x head_dim per token) of window w with the first half of window w - 1, over 2m places. A
  lightning indexer pools its own smaller rows the same way, scores them against its queries (sum over its
  heads of weight x ReLU(q . k) x index_head_dim ** -0.5) and each query reads only its `index_topk` best
  complete rows.

Every softmax has a learnt sink logit per head (a column whose probability is dropped).

Why the cache holds per-token rows, not pooled ones: a pooled row depends on m (or 2m) tokens and the
chunk that finishes a window may not hold them all (chunked prefill, decode), so the layer keeps what
each token contributes, `[kv | pool kv | pool gate | indexer kv | indexer gate]` (`row_width`), one
latent-style row per token in the paged KV cache, and pools the finished windows from them at each step.
Every row is then a function of its token's prefix alone, written once at its slot like a K row, so
chunked prefill, preemption (recompute), prefix-cache hits and rejected speculative drafts need nothing
beyond what the KV cache manager already does for plain attention. The cost: each step re-pools a
request's finished windows (O(context) per layer, as reading a full KV cache is) and the rows are wider
than one pooled row per m tokens; every row is kept while the request lives (no window freeing).
The cache is read as slot-major rows (TORCH_SDPA's layout), as DeepSeek-V3.2's sparse gather reads it
(`sparse_attention.step_context_slots`). Under torch.compile the layer's work is one opaque custom op
(`pagellm::compressed_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention_backends._base import store_kv
from pagellm.models.context import ForwardContext, get_forward_context
from pagellm.models.layers.rotary import rotate_pairs
from pagellm.models.layers.sparse_attention import step_context_slots

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
KINDS = (SLIDING, CSA, HCA)


def row_width(kind: str, head_dim: int, index_dim: int) -> int:
    """Elements a token keeps per layer: its K (= V) row, then what it gives the pooled rows."""
    if kind == SLIDING:
        return head_dim
    if kind == HCA:
        return 3 * head_dim  # kv, pool kv, pool gate
    return 5 * head_dim + 4 * index_dim  # kv, pool kv and gate (2 x head_dim each), the indexer's (2 x)


@dataclass(frozen=True)
class LayerShape:
    """One layer's constants (plain numbers, so that the compiled graph's op takes them as arguments)."""

    kind: str
    head_dim: int
    index_dim: int
    rate: int  # tokens per pooled row (0: sliding)
    window: int
    topk: int
    eps: float


@dataclass(frozen=True)
class Pooling:
    """One pooled series' learnt tensors: the bias per place in the window [m, width] and the norm weight."""

    bias: torch.Tensor
    norm: torch.Tensor


@dataclass(frozen=True)
class LayerTensors:
    """The layer's tensors the attention reads besides its inputs: sinks [H], the pooled rows' and the
    indexer's `Pooling` (None where the kind has none) and the compressed rope's inv_freq and scaling."""

    sinks: torch.Tensor
    pool: Pooling | None
    index_pool: Pooling | None
    inv_freq: torch.Tensor
    rope_scaling: float


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]: the last 2 x cos.shape[-1] features rotated in interleaved pairs (V4 lays each head
    out as [nope | rope]); cos/sin [N, rope // 2]."""
    rope = 2 * cos.shape[-1]
    return torch.cat([x[..., :-rope], rotate_pairs(x[..., -rope:], cos, sin)], dim=-1)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' DeepseekV4RotaryEmbedding: one angle per pair, times the rope type's scaling."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def weighted_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm: normalised in float32, times the float32 weight, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, pool: Pooling, rate: int, overlap: bool, eps: float):
    """The pooled rows [n, d] (not rotated) of the n = len // rate finished windows of per-token kv and
    gate rows [len, width]. `overlap` (CSA): width is 2d and row w pools window w's second halves with
    window w - 1's first halves (nothing before window 0), as transformers' compressors lay them out."""
    n = kv.shape[0] // rate
    kv = kv[: n * rate].view(n, rate, kv.shape[-1])
    gate = gate[: n * rate].view(n, rate, gate.shape[-1]) + pool.bias
    if overlap:
        d = kv.shape[-1] // 2
        prev_kv = torch.cat([kv.new_zeros(1, rate, d), kv[:-1, :, :d]])[:n]  # [:n]: none when n is 0
        prev_gate = torch.cat([gate.new_full((1, rate, d), float("-inf")), gate[:-1, :, :d]])[:n]
        kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return weighted_rms(pooled, pool.norm, eps)


def rotated_pool(kv, gate, pool: Pooling, shape: LayerShape, t: LayerTensors, overlap: bool) -> torch.Tensor:
    """`pool_windows`, each row rotated at its window's first position."""
    rows = pool_windows(kv, gate, pool, shape.rate, overlap, shape.eps)
    positions = torch.arange(rows.shape[0], device=rows.device) * shape.rate
    cos, sin = cos_sin(positions, t.inv_freq, t.rope_scaling)
    return rotate_tail(rows.unsqueeze(1), cos, sin)[:, 0]


def split_row(rows: torch.Tensor, shape: LayerShape) -> list[torch.Tensor]:
    """A layer's cached rows [S, row_width] as [kv, pool kv, pool gate(, index kv, index gate)]."""
    d, di = shape.head_dim, shape.index_dim
    if shape.kind == SLIDING:
        return [rows]
    if shape.kind == HCA:
        return list(rows.split([d, d, d], dim=-1))
    return list(rows.split([d, 2 * d, 2 * d, 2 * di, 2 * di], dim=-1))


def index_choice(
    index_q: torch.Tensor, index_w: torch.Tensor, keys: torch.Tensor, complete: torch.Tensor, topk: int
) -> torch.Tensor:
    """[Q, n] bool: the pooled rows each query reads. index_q [Q, Hi, Di] (rotated), index_w [Q, Hi]
    (float32, times Hi ** -0.5), keys [n, Di] (the indexer's pooled rows), complete [Q, n] which rows are
    finished for the query. Scored as transformers' DeepseekV4IndexerScorer; the top k of the finished."""
    n = keys.shape[0]
    chosen = torch.zeros_like(complete)
    if n == 0:
        return chosen
    dots = torch.matmul(index_q.float(), keys.float().t())  # [Q, Hi, n]
    scores = (dots.relu() * index_q.shape[-1] ** -0.5 * index_w.float().unsqueeze(-1)).sum(dim=1)
    best = scores.masked_fill(~complete, float("-inf")).topk(min(topk, n), dim=-1).indices
    chosen.scatter_(1, best, True)
    return chosen & complete


def attend_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [Q, H, D] over keys [K, D] (V = K) where visible [Q, K], with one sink logit per head [H] in the
    softmax (its probability dropped), as transformers' eager_attention_forward for DeepSeek-V4: the scores
    in the model's dtype, the softmax in float32 (the float32 sinks widen the concatenation there too)."""
    logits = torch.einsum("qhd,kd->qhk", q, keys) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat([logits.float(), sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)


def window_keys(
    rows: torch.Tensor, positions: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K rows [K, D] the queries at `positions` (consecutive, the last one the context's last) reach in
    the window, and which of them each query sees [Q, K]."""
    seq_len = rows.shape[0]
    first = max(0, int(positions[0]) - window + 1)
    keys_at = torch.arange(first, seq_len, device=rows.device)
    behind = positions[:, None] - keys_at[None, :]
    return rows[first:], (behind >= 0) & (behind < window)


def attend_request(
    q: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    rows: torch.Tensor,
    positions: torch.Tensor,
    shape: LayerShape,
    t: LayerTensors,
) -> torch.Tensor:
    """One request's queries q [Q, H, D] at `positions` over its cached rows [S, row_width] -> [Q, H, D]."""
    parts = split_row(rows, shape)
    keys, visible = window_keys(parts[0], positions, shape.window)
    if shape.kind != SLIDING:
        pooled = rotated_pool(parts[1], parts[2], t.pool, shape, t, overlap=shape.kind == CSA)
        entries = torch.arange(pooled.shape[0], device=q.device)
        complete = entries[None, :] < ((positions + 1) // shape.rate)[:, None]
        if shape.kind == CSA:
            index_keys = rotated_pool(parts[3], parts[4], t.index_pool, shape, t, overlap=True)
            complete = index_choice(*index, index_keys, complete, shape.topk)
        keys, visible = torch.cat([keys, pooled]), torch.cat([visible, complete], dim=1)
    return attend_with_sinks(q, keys.to(q.dtype), visible, t.sinks)


def compressed_attention_forward(
    q: torch.Tensor,
    rows: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    layer_idx: int,
    shape: LayerShape,
    t: LayerTensors,
    ctx: ForwardContext,
) -> torch.Tensor:
    """Store the step's rows [T, row_width] at their slots, then each request's queries q [T, H, D] over its
    context's rows (`index`: the indexer's queries [T, Hi, Di] and head weights [T, Hi], CSA only)."""
    meta, cache = ctx.metadata_of(layer_idx), ctx.kv_caches[layer_idx]
    store_kv(cache, rows.unsqueeze(1), None, meta)
    slot_rows, block_size = cache[0].reshape(-1, cache.shape[-1]), cache.shape[2]
    starts, out = meta.batch.query_start_loc_cpu.tolist(), torch.zeros_like(q)
    for r, seq_len in enumerate(meta.batch.seq_lens_cpu.tolist()):
        first, end = starts[r], starts[r + 1]
        if end == first:
            continue
        context = slot_rows.index_select(0, step_context_slots(ctx, layer_idx, r, seq_len, block_size))
        positions = torch.arange(seq_len - (end - first), seq_len, device=q.device)
        mine = None if index is None else (index[0][first:end], index[1][first:end])
        out[first:end] = attend_request(q[first:end], mine, context.to(rows.dtype), positions, shape, t)
    return out


def _pool_args(pool: Pooling | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pool is None:
        empty = like.new_empty(0)
        return empty, empty
    return pool.bias, pool.norm


def _pool_of(bias: torch.Tensor, norm: torch.Tensor) -> Pooling | None:
    return None if bias.numel() == 0 else Pooling(bias, norm)


@torch.library.custom_op("pagellm::compressed_attention", mutates_args=())
def _compressed_attention_op(
    q: torch.Tensor,
    rows: torch.Tensor,
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    tensors: list[torch.Tensor],
    layer_index: torch.Tensor,
    kind: str,
    ints: list[int],
    floats: list[float],
) -> torch.Tensor:
    """`compressed_attention_forward` in a compiled graph (the layer as a tensor, as `pagellm::attention`):
    tensors = sinks, pool bias, pool norm, index bias, index norm, inv_freq (empty where the kind has none);
    ints = head_dim, index_dim, rate, window, topk; floats = eps, rope scaling."""
    sinks, bias, norm, ibias, inorm, inv_freq = tensors
    shape = LayerShape(kind, *ints, floats[0])
    t = LayerTensors(sinks, _pool_of(bias, norm), _pool_of(ibias, inorm), inv_freq, floats[1])
    index = (index_q, index_w) if kind == CSA else None
    return compressed_attention_forward(q, rows, index, int(layer_index), shape, t, get_forward_context())


@_compressed_attention_op.register_fake
def _(q, rows, index_q, index_w, tensors, layer_index, kind, ints, floats) -> torch.Tensor:
    return torch.empty_like(q)


def compressed_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    layer_index: torch.Tensor,
    shape: LayerShape,
    t: LayerTensors,
) -> torch.Tensor:
    """The layer's attention (q [T, H, D] rotated, its tokens' rows [T, row_width]) -> [T, H, D], before the
    output's rope is rotated back. Eager: straight to `compressed_attention_forward`; compiling: the op."""
    if torch.compiler.is_compiling():
        index_q, index_w = index if index is not None else (q.new_empty(0), q.new_empty(0))
        tensors = [t.sinks, *_pool_args(t.pool, q), *_pool_args(t.index_pool, q), t.inv_freq]
        ints = [shape.head_dim, shape.index_dim, shape.rate, shape.window, shape.topk]
        return torch.ops.pagellm.compressed_attention(
            q, rows, index_q, index_w, tensors, layer_index, shape.kind, ints, [shape.eps, t.rope_scaling]
        )
    return compressed_attention_forward(q, rows, index, int(layer_index), shape, t, get_forward_context())
