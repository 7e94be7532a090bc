"""TRITON_ATTN: one Triton kernel for the whole mixed batch, on any GPU Triton targets (CUDA, ROCm, XPU).

Each program takes a tile of one request's query tokens times the query heads of one KV head (so GQA
reads each key once for the whole group) and walks that request's context, BLOCK_N keys at a time gathered
through its block table, with an online softmax in float32: prefill chunks, their cached context and
single-token decodes all go through the same code. The tile is sized per step: the smallest power of two
(at least 16, tl.dot's minimum) that holds the step's longest query times the group, so a decode step's
tiles hold just the group and a prefill's take up to 64 query rows. When a step has fewer programs than
the device has SMs (decodes of a few requests over 1-2 KV heads), each program walks only a slice of its
context and writes its partial maximum, sum and output in float32, and a second kernel merges the slices
(split-K, flash-decoding). A logit soft-cap is applied to each tile's scores before the mask; sink logits
start the online softmax of the first slice (running max = the sink, sum = 1, as a key with no value).
Head sizes are padded to a power of two inside the kernel. The new K/V are
stored with `index_copy_` first, so the kernel only reads the cache. The kernel is jitted on first use in each interpreter
mode, so forwards run while `TRITON_INTERPRET=1` is set run it on CPU tensors (tests), the others compiled.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from pagellm.attention_backends._base import PagedBackend, PagedMetadata, store_kv
from pagellm.core.attention import AttentionBackend, AttentionBatch, AttentionSpec
from pagellm.core.platform import Platform
from pagellm.core.triton_language import bind_triton_language
from pagellm.plugins import hookimpl

tl = None  # triton.language once a kernel is needed (`bind_triton_language`)

PAGELLM_PLUGIN_API = "1.0"

MAX_GROUP = 16
"""Query heads per KV head: a decode tile holds one group, in at most 16 rows (tl.dot's minimum)."""
MIN_BLOCK_M = 16
MAX_SPLITS = 16
"""Context slices per tile at most (split-K): enough to fill the device several times over at decode."""
INTERPRETER_COMPUTE_UNITS = 4
"""What the interpreter counts as the device's SMs: small, so tests of a few requests take the split path."""


@dataclass(frozen=True)
class TilePlan:
    """How one step is cut into programs, for one layer shape: grid (tiles, KV heads, splits)."""

    block_m: int
    """Query rows per tile (its query tokens times the group): a power of two, at least 16."""
    tile_reqs: torch.Tensor
    """int32 [tiles]: each tile's request."""
    tile_firsts: torch.Tensor
    """int32 [tiles]: each tile's first query index within its request."""
    num_splits: int
    """Slices of the context per tile, a power of two; 1: no split-K, the kernel writes the output."""


@dataclass
class TritonAttnMetadata(PagedMetadata):
    plans: dict[tuple[int, ...], TilePlan] = field(default_factory=dict)

    def tile_plan(
        self, group: int, num_kv: int, window: int, block_n: int, max_block_m: int, compute_units: int
    ) -> TilePlan:
        """The step's tiles and splits, from its host-side lengths (no sync), built once per step."""
        key = (group, num_kv, window, block_n, max_block_m, compute_units)
        if key not in self.plans:
            self.plans[key] = _plan_tiles(self.batch, *key)
        return self.plans[key]


def _plan_tiles(
    batch: AttentionBatch,
    group: int,
    num_kv: int,
    window: int,
    block_n: int,
    max_block_m: int,
    compute_units: int,
) -> TilePlan:
    """Tiles of the smallest power-of-two height that holds the longest query times the group (capped at
    `max_block_m`); split the contexts when the programs would not fill `compute_units` SMs, into as many
    slices (a power of two) as fill them, but no more than the longest visible context has key tiles."""
    starts = batch.query_start_loc_cpu.tolist()
    seq_lens = batch.seq_lens_cpu.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    longest = max(query_lens, default=0)
    block_m = min(max(MIN_BLOCK_M, 1 << (longest * group - 1).bit_length()), max_block_m)
    tokens_per_tile = block_m // group
    reqs, firsts, key_tiles = [], [], 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for first in range(0, query_len, tokens_per_tile):
            reqs.append(i)
            firsts.append(first)
        if query_len:
            lo = max(seq_len - query_len - window + 1, 0) if window else 0
            key_tiles = max(key_tiles, -(-seq_len // block_n) - lo // block_n)
    programs = len(reqs) * num_kv
    splits = 1
    if 0 < programs < compute_units:
        splits = min(-(-compute_units // programs), key_tiles, MAX_SPLITS)
        splits = 1 << (splits.bit_length() - 1)  # a power of two: few kernel variants, and tl.arange takes it
    device = batch.block_tables.device
    return TilePlan(
        block_m,
        torch.tensor(reqs, dtype=torch.int32, device=device),
        torch.tensor(firsts, dtype=torch.int32, device=device),
        splits,
    )


class TritonAttnBackend(PagedBackend):
    name = "TRITON_ATTN"
    device_types = ("cuda", "xpu")  # ROCm builds of torch report "cuda"
    head_sizes = (64, 80, 96, 128, 256)
    block_sizes = (16, 32, 64)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True
    metadata_type = TritonAttnMetadata
    cuda_graph_decode = True
    version = "2"  # tiles sized per step, split-K

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        reasons = super().unsupported_reasons(spec, platform)
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed (pip install triton)")
        if spec.num_heads // spec.num_kv_heads > MAX_GROUP:
            reasons.append(f"more than {MAX_GROUP} query heads per KV head")
        return reasons

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttnMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new K/V, then run the step's tiles through the kernel (split-K: then merge the
        slices)."""
        s = self.spec
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()  # the layer's parameter already is
        _, _, block_size, num_kv, head_size = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        store_kv(kv_cache, k, v, metadata)

        group = s.num_heads // num_kv
        head_pad = max(16, 1 << (head_size - 1).bit_length())
        dot_dtype = _dot_dtype(q.dtype)
        block_n, max_block_m = _tile_limits(head_pad, dot_dtype.primitive_bitwidth // 8)
        plan = metadata.tile_plan(
            group, num_kv, s.sliding_window or 0, block_n, max_block_m, _compute_units(q.device)
        )
        out = torch.empty_like(q)
        num_tiles = plan.tile_reqs.numel()
        if num_tiles == 0:
            return out
        splits = plan.num_splits
        partial_ml, partial_out = self._split_scratch(q, out, head_size, splits)
        batch = metadata.batch
        _kernel()[(num_tiles, num_kv, splits)](
            out,
            partial_ml,
            partial_out,
            q,
            k_cache,
            v_cache,
            q if sinks is None else sinks,  # not read without sinks
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            plan.tile_reqs,
            plan.tile_firsts,
            s.softmax_scale,
            q.shape[0] * s.num_heads * splits,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            batch.block_tables.stride(0),
            GROUP=group,
            NUM_HEADS=s.num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            BLOCK_M=plan.block_m,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            SLIDING_WINDOW=s.sliding_window or 0,
            SOFT_CAP=float(s.logits_soft_cap or 0.0),
            HAS_SINKS=sinks is not None,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32 where fp32 was asked for
            num_warps=_num_warps(plan.block_m, head_pad),
            num_stages=2,
        )
        if splits > 1:
            self._merge(
                out, partial_ml, partial_out, q.shape[0], batch.num_tokens, head_size, head_pad, splits
            )
        return out

    def _split_scratch(
        self, q: torch.Tensor, out: torch.Tensor, head_size: int, splits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-K's float32 partials, per (token, query head, slice): the running max and sum, and the
        unnormalised output. Without splits the kernel writes `out` itself and reads neither: both are
        `out`, a placeholder."""
        num_heads = self.spec.num_heads
        if splits > 1:
            partial_ml = torch.empty(2, q.shape[0], num_heads, splits, dtype=torch.float32, device=q.device)
            partial_out = torch.empty(
                q.shape[0], num_heads, splits, head_size, dtype=torch.float32, device=q.device
            )
        else:  # not read: the kernel writes `out` itself
            partial_ml = partial_out = out
        return partial_ml, partial_out

    def _merge(
        self,
        out: torch.Tensor,
        partial_ml: torch.Tensor,
        partial_out: torch.Tensor,
        num_rows: int,
        num_tokens: int,
        head_size: int,
        head_pad: int,
        splits: int,
    ) -> None:
        """The second kernel of split-K: each (token, query head)'s slices merged into `out`. `num_rows`:
        the tokens `partial_ml` was sized for, which sets its stride between max and sum."""
        num_heads = self.spec.num_heads
        _merge_kernel()[(num_tokens, num_heads)](
            out,
            partial_ml,
            partial_out,
            num_rows * num_heads * splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SPLITS=splits,
            num_warps=4,
        )


def _tile_limits(head_pad: int, dot_bytes: int) -> tuple[int, int]:
    """(BLOCK_N, largest BLOCK_M) for a head size and the bytes of tl.dot's operands: 8 KiB of keys per
    step of the loop and at most 16 KiB of queries per tile (in 16-bit types at head size 128: 32 keys,
    64 query rows; each between 16 and 64). Compiled for sm_80 and sm_90, two pipeline stages of K and V
    and the query tile then take at most about 50 KiB of shared memory, under Turing's and an AMD CU's
    64 KiB."""
    block_n = max(16, min(64, 8192 // (head_pad * dot_bytes)))
    return block_n, max(16, min(64, 16384 // (head_pad * dot_bytes)))


def _num_warps(block_m: int, head_pad: int) -> int:
    """8 warps for tiles of more than 4096 float32 accumulators (64 rows at head size 128), which spill
    registers with 4 (ptxas for sm_90); 4 otherwise."""
    return 8 if block_m * head_pad > 4096 else 4


def _compute_units(device: torch.device) -> int:
    """How many programs fill the device: its SMs (CUDA; compute units on ROCm; Xe cores on XPU), a fact
    read once per device after selection; a small fixed number for CPU tensors under the interpreter."""
    if device.type == "cpu":
        return INTERPRETER_COMPUTE_UNITS
    return _device_compute_units(device.type, device.index or 0)


@functools.cache
def _device_compute_units(device_type: str, index: int) -> int:
    properties = getattr(torch, device_type).get_device_properties(index)
    if device_type == "xpu":
        return properties.gpu_subslice_count
    return properties.multi_processor_count


def _dot_dtype(dtype: torch.dtype):
    """The dtype tl.dot multiplies in: the compute dtype, except float32 for bfloat16 under the
    interpreter, which runs on numpy and has no bfloat16 matmul."""
    bind_triton_language(globals())
    if dtype == torch.bfloat16:
        return tl.float32 if _interpreting() else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: `triton.knobs` from Triton 3.4, the environment
    variable it reads before that."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel():
    """The kernel for the current interpreter mode: `triton.jit` picks interpreted or compiled when it wraps
    the function, so one cached kernel would run a whole process in the mode of its first call."""
    return _kernel_in_mode(_interpreting())


@functools.cache
def _kernel_in_mode(interpreting: bool):
    import triton

    bind_triton_language(globals())
    return triton.jit(_paged_attention)


def _merge_kernel():
    """The split-K merge, jitted per interpreter mode as `_kernel` is."""
    return _merge_kernel_in_mode(_interpreting())


@functools.cache
def _merge_kernel_in_mode(interpreting: bool):
    import triton

    bind_triton_language(globals())
    return triton.jit(_merge_splits)


def _paged_attention(
    out_ptr,
    partial_ml_ptr,
    partial_out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    sinks_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_reqs_ptr,
    tile_firsts_ptr,
    scale,
    partial_stride,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_table,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Rows of the tile are (query token, head in group) pairs; query token j of a request with L tokens
    and Q new ones sits at position L - Q + j and sees positions <= that (and > that - window). Keys come
    BLOCK_N at a time, each through the block table entry of its own position, so BLOCK_N need not match
    the cache's block size. With NUM_SPLITS > 1, program (tile, KV head, split) walks the split-th slice
    of the tile's key tiles and writes its partial max, sum and unnormalised output for `_merge_splits`.
    SOFT_CAP > 0 caps the scores (cap * tanh(score / cap)); HAS_SINKS reads each head's sink logit (float32)
    into the first slice's running max and sum, where it joins the denominator and adds no value."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_reqs_ptr + tile)
    first = tl.load(tile_firsts_ptr + tile)
    query_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    TOKENS: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    query_idx = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (query_idx < query_len)
    query_pos = context_len + query_idx
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE

    q_offsets = (
        (query_start + query_idx)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    )
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

    # Only core builtins here: tl.zeros, tl.max, tl.sum and tl.cdiv are jit functions, which the interpreter
    # cannot call if triton was imported before TRITON_INTERPRET was set; tl.reduce with the combine
    # functions tl.max and tl.sum pass it is what they run (the interpreter maps those to numpy).
    last_pos = tl.minimum(context_len + first + TOKENS, seq_len)  # one past the tile's last query position
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context_len + first - SLIDING_WINDOW + 1, 0) // BLOCK_N
    hi = (last_pos + BLOCK_N - 1) // BLOCK_N
    if NUM_SPLITS > 1:
        per_split = (hi - lo + NUM_SPLITS - 1) // NUM_SPLITS
        lo = lo + tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, hi)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if HAS_SINKS:  # a key of logit `sink` and value 0, seen once: by the first slice
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        first_slice = tl.program_id(2) == 0
        m = tl.where(first_slice, sink, m)
        l = tl.where(first_slice, 1.0, l)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for j in range(lo, hi):
        key_pos = j * BLOCK_N + keys
        key_ok = key_pos < seq_len  # past it: no block table entry, and cache slots never written
        block = tl.load(
            block_tables_ptr + req * stride_table + key_pos // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        kv_offsets = (
            block[:, None] * stride_k_block
            + (key_pos % BLOCK_SIZE)[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dims[None, :]
        )
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFT_CAP > 0:  # cap * tanh(s / cap), tanh from exp of -2|s / cap| (no overflow)
            x = scores / SOFT_CAP
            e = tl.exp(-2.0 * tl.where(x < 0, -x, x))
            t = (1.0 - e) / (1.0 + e)
            scores = SOFT_CAP * tl.where(x < 0, -t, t)
        diff = query_pos[:, None] - key_pos[None, :]
        visible = diff >= 0
        if SLIDING_WINDOW > 0:
            visible = visible & (diff < SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(scores, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    token = query_start + query_idx
    if NUM_SPLITS > 1:
        slot = (token * NUM_HEADS + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(partial_ml_ptr + slot, m, mask=row_ok)
        tl.store(partial_ml_ptr + partial_stride + slot, l, mask=row_ok)
        tl.store(
            partial_out_ptr + slot[:, None] * HEAD_SIZE + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
        tl.store(
            out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
        )


def _merge_splits(
    out_ptr,
    partial_ml_ptr,
    partial_out_ptr,
    partial_stride,
    stride_o_token,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, query head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s with M = max_s m_s;
    a slice that saw no visible key has m = -inf, l = 0 and weighs nothing."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slots = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(partial_ml_ptr + slots)
    l = tl.load(partial_ml_ptr + partial_stride + slots)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.reduce(l * weight, 0, tl.standard._sum_combine)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    acc = tl.load(
        partial_out_ptr + slots[:, None] * HEAD_SIZE + dims[None, :], mask=dim_ok[None, :], other=0.0
    )
    o = tl.reduce(acc * weight[:, None], 0, tl.standard._sum_combine) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [TritonAttnBackend]
