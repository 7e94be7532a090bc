"""TRITON_ATTN: one Triton kernel for the whole mixed batch, on any GPU Triton targets (CUDA, ROCm, XPU).

Each program takes a tile of one request's query tokens times the query heads of one KV head (so GQA
reads each key once for the whole group) and walks that request's blocks through its block table with an
online softmax in float32: prefill chunks, their cached context and single-token decodes all go through
the same code. Head sizes are padded to a power of two inside the kernel. The new K/V are stored with
`index_copy_` first, so the kernel only reads the cache. Triton is imported lazily and the kernel compiled
on first use, so `TRITON_INTERPRET=1` set before the first forward runs it on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from pagellm.attention_backends._base import PagedBackend, PagedMetadata, store_kv
from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import hookimpl

try:
    import triton.language as tl
except ImportError:  # unsupported_reasons says so; the kernel below is never compiled
    tl = None

PAGELLM_PLUGIN_API = "1.0"

BLOCK_M = 16
"""Query rows per program (query tokens times the heads of one KV group); 16 is tl.dot's minimum."""


@dataclass
class TritonAttnMetadata(PagedMetadata):
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def query_tiles(self, tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, first query index within the request) of every program's tile, built once per step."""
        if tokens_per_tile not in self.tiles:
            starts = self.batch.query_start_loc_cpu.tolist()
            reqs, firsts = [], []
            for i in range(len(starts) - 1):
                for first in range(0, starts[i + 1] - starts[i], tokens_per_tile):
                    reqs.append(i)
                    firsts.append(first)
            device = self.batch.block_tables.device
            self.tiles[tokens_per_tile] = (
                torch.tensor(reqs, dtype=torch.int32, device=device),
                torch.tensor(firsts, dtype=torch.int32, device=device),
            )
        return self.tiles[tokens_per_tile]


class TritonAttnBackend(PagedBackend):
    name = "TRITON_ATTN"
    device_types = ("cuda", "xpu")  # ROCm builds of torch report "cuda"
    head_sizes = (64, 80, 96, 128, 256)
    block_sizes = (16, 32, 64)
    supports_sliding_window = True
    metadata_type = TritonAttnMetadata

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        reasons = super().unsupported_reasons(spec, platform)
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed (pip install triton)")
        if spec.num_heads // spec.num_kv_heads > BLOCK_M:
            reasons.append(f"more than {BLOCK_M} query heads per KV head")
        return reasons

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttnMetadata,
    ) -> torch.Tensor:
        s = self.spec
        _, _, block_size, num_kv, head_size = kv_cache.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        store_kv(kv_cache, k, v, metadata)

        group = s.num_heads // num_kv
        tile_reqs, tile_firsts = metadata.query_tiles(BLOCK_M // group)
        out = torch.empty_like(q)
        if tile_reqs.numel() == 0:
            return out
        batch = metadata.batch
        dot_dtype = _dot_dtype(q.dtype)
        _kernel()[(tile_reqs.numel(), num_kv)](
            out,
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            tile_reqs,
            tile_firsts,
            s.softmax_scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            batch.block_tables.stride(0),
            GROUP=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=max(16, 1 << (head_size - 1).bit_length()),
            BLOCK_SIZE=block_size,
            BLOCK_M=BLOCK_M,
            SLIDING_WINDOW=s.sliding_window or 0,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # no TF32 where fp32 was asked for
        )
        return out


def _dot_dtype(dtype: torch.dtype):
    """The dtype tl.dot multiplies in: the compute dtype, except float32 for bfloat16 under the
    interpreter, which runs on numpy and has no bfloat16 matmul."""
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


@functools.cache
def _kernel():
    """Compiled on first use, so TRITON_INTERPRET is read then, not at import."""
    import triton

    return triton.jit(_paged_attention)


def _paged_attention(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_reqs_ptr,
    tile_firsts_ptr,
    scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Rows of the tile are (query token, head in group) pairs; query token j of a request with L tokens
    and Q new ones sits at position L - Q + j and sees positions <= that (and > that - window)."""
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

    last_pos = tl.minimum(context_len + first + TOKENS, seq_len)  # one past the tile's last query position
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context_len + first - SLIDING_WINDOW + 1, 0) // BLOCK_SIZE
    hi = tl.cdiv(last_pos, BLOCK_SIZE)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(lo, hi):
        block = tl.load(block_tables_ptr + req * stride_table + j).to(tl.int64)
        kv_offsets = (
            block * stride_k_block + slots[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :]
        )
        k = tl.load(k_cache_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        key_pos = j * BLOCK_SIZE + slots
        diff = query_pos[:, None] - key_pos[None, :]
        visible = diff >= 0
        if SLIDING_WINDOW > 0:
            visible = visible & (diff < SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_offsets = (
        (query_start + query_idx)[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
    )
    tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [TritonAttnBackend]
