"""CPU_ATTN: paged attention tuned for CPUs.

The cache keeps each KV head's blocks together, [2, num_kv_heads, num_blocks, block_size, head_size].
Decodes go to a native kernel (platforms/cpu_kernels/paged_attention.cpp, built on first use) that reads K/V in place
through the block table with an online softmax, splitting long contexts so every core has work (on AMX CPUs,
bfloat16 scores and value sums are tile products). Where the
kernel cannot be built, decodes of similar length share two `bmm` calls over K/V gathered block by block
(whole blocks of block_size * head_size contiguous elements), with a float32 softmax between them. Each
prefill chunk gets one call of torch's fused kernel against exactly the blocks its queries can see: at
that size the work is GEMM-bound and the gather is small beside it.

Soft-capped layers: the kernel caps each work item's scores; prefills and the fallback's decodes compute
in float32 ops (`explicit_attention` for prefills: torch's fused kernel cannot cap). Sink logits: the
kernel adds them when it normalises each row; prefills take the fused kernel's log-sum-exp and rescale
(`scale_by_sinks`); the fallback's decodes add a sink column to the softmax.

Latent layers (MLA, `AttentionSpec.latent_kv`): the cache is [1, num_kv_heads, num_blocks, block_size,
head_size], one row per token, and V is the first v_size elements of each gathered row. They run the
PyTorch path for decodes too (the grouped `bmm`s above, as MQA over the latent rows): the native kernel
reads V rows as wide as K's and writes outputs of K's width. Prefills with V narrower than K take torch's
math kernel (the fused one wants one head size), or `explicit_attention` with sinks.

Chunked local attention (`attention_chunk`, Llama 4's rope layers) runs the PyTorch path, decodes too (the
native kernel knows windows, not chunks): each query's chunk gathered, earlier chunks' keys masked.

Batch-invariant specs (`--batch-invariant`): every query token, prefill chunks' included, goes to the native
kernel in its fixed order with whole contexts (no flash-decoding split), so a token's output is the same
bits in a prefill chunk or a decode, alone or in any batch; latent layers cannot (the PyTorch path's `bmm`
over a group of decodes is not)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pagellm.attention_backends._base import (
    PagedBackend,
    PagedMetadata,
    dequantize_int8_rows,
    explicit_attention,
    first_visible,
    scale_by_sinks,
    store_kv,
)
from pagellm.core.attention import AttentionBackend, AttentionBatch, AttentionSpec
from pagellm.platforms import cpu_kernels
from pagellm.plugins import hookimpl

if TYPE_CHECKING:
    from pagellm.core.platform import Platform

PAGELLM_PLUGIN_API = "1.0"

DECODE_GROUP_SPREAD = 2
"""A decode joins the current group while its block count is at most this many times the group's
smallest: padding then costs at most half of the group's work."""
DECODE_GROUP_TOKENS = 1 << 16
"""Most context tokens (padding included) one decode group gathers, which bounds the gather workspace:
65536 tokens x KV heads x head size x 2 (K and V), e.g. 256 MiB at 8 KV heads of 128 in bfloat16."""


@dataclass
class _Prefill:
    tokens: slice  # the request's query tokens in the flat batch
    blocks: torch.Tensor | None  # cache blocks it reads; None: it reads only its own new k/v
    skip: int  # positions to drop from the first gathered block (sliding window)
    mask: torch.Tensor | None  # additive [Q, C]; None: plain causal over its own k/v


@dataclass
class _DecodeGroup:
    tokens: slice | torch.Tensor  # the group's single-token requests in the flat batch
    blocks: torch.Tensor  # [B * blocks_per_req] cache blocks, padded with block 0
    mask: torch.Tensor  # additive float32 [1, B, 1, width]: 0 where visible, -inf elsewhere


@dataclass
class _Plan:
    prefills: list[_Prefill]
    decodes: list[_DecodeGroup]  # for the PyTorch path
    kernel_reqs: torch.Tensor | None = None  # int32 decode requests for the native kernel
    partition: int = 0  # context tokens per kernel work item


@dataclass
class CpuAttnMetadata(PagedMetadata):
    plans: dict[tuple, _Plan] = field(default_factory=dict)
    native: object | None = None  # the kernels, while they hold this forward's tables (begin_forward)

    def begin_forward(self, kv_caches: Sequence[torch.Tensor], layers: Sequence[Any]) -> None:
        """Hand a decode-only step to the native `pagellm::cpu_attention`, which compiled graphs call:
        the step's tables and every layer's cache and plan, once. Any other step (prefill chunks, a cache
        in another dtype than the model's, another backend, a pipeline stage's share of the layers, whose
        forward is never compiled) keeps the Python op."""
        if not layers or len(kv_caches) != len(layers) or any(layer is None for layer in layers):
            return
        impls = [layer.impl for layer in layers]
        kernel = getattr(impls[0], "kernel", None)
        if kernel is None or not all(
            isinstance(impl, CpuAttnBackend) and impl.kernel is not None for impl in impls
        ):
            return
        # one list per field, one entry per layer: the op's schema has no list of tuples
        caches, kinds, scales, windows, reqs, partitions, amx, soft_caps, all_sinks = ([] for _ in range(9))
        for layer, impl, kv_cache in zip(layers, impls, kv_caches, strict=True):
            s = impl.spec
            if kv_cache.dtype != s.dtype:
                return
            plan = self.plan(s, kv_cache.shape[3], True, kv_cache.shape[1], impl.prefills_on_kernel)
            if plan.prefills or plan.kernel_reqs is None:
                return
            sinks = getattr(layer, "sinks", None) if s.has_sinks else None
            caches.append(kv_cache)
            kinds.append(_CACHE_KINDS[kv_cache.dtype])
            scales.append(s.softmax_scale)
            windows.append(s.sliding_window or 0)
            reqs.append(plan.kernel_reqs)
            partitions.append(plan.partition)
            amx.append(impl.use_amx)
            soft_caps.append(s.logits_soft_cap or 0.0)
            all_sinks.append(None if sinks is None else sinks.detach().float().contiguous())
        b = self.batch
        kernel.begin_native_step(
            b.block_tables,
            b.seq_lens_cpu,
            b.query_start_loc_cpu,
            b.slot_mapping,
            caches,
            kinds,
            scales,
            windows,
            reqs,
            partitions,
            amx,
            soft_caps,
            all_sinks,
            impls[0].spec.batch_invariant,
        )
        self.native = kernel

    def end_forward(self) -> None:
        if self.native is not None:
            self.native.end_native_step()
            self.native = None

    def plan(
        self,
        spec: AttentionSpec,
        block_size: int,
        kernel: bool,
        num_kv: int,
        prefills_on_kernel: bool = False,
    ) -> _Plan:
        """Gather indices and masks, built by the first layer that asks and reused by the others."""
        key = (
            spec.sliding_window,
            block_size,
            spec.dtype,
            kernel,
            spec.batch_invariant,
            prefills_on_kernel,
            spec.attention_chunk,
        )
        if key not in self.plans:
            self.plans[key] = _make_plan(
                self.batch,
                spec.sliding_window or 0,
                block_size,
                spec.dtype,
                kernel,
                num_kv,
                spec.batch_invariant,
                prefills_on_kernel,
                spec.attention_chunk or 0,
            )
        return self.plans[key]


class CpuAttnBackend(PagedBackend):
    name = "CPU_ATTN"
    version = "3"  # in-place decode kernel, AMX tiles for bfloat16
    device_types = ("cpu",)
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supports_latent_kv = True
    supports_batch_invariant = True
    supports_attention_chunk = True  # on the PyTorch path
    kv_cache_dtypes = (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
    )
    metadata_type = CpuAttnMetadata
    use_amx = True
    """bfloat16 decodes may multiply AMX tiles where the CPU has them (False: the AVX-512 path; tests)."""

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        # latent and chunked layers: the PyTorch path
        self.kernel = None if spec.latent_kv or spec.attention_chunk else cpu_kernels.load()
        if self.kernel is not None:
            self.graph_op = torch.ops.pagellm.cpu_attention.default

    @functools.cached_property
    def prefills_on_kernel(self) -> bool:
        """Whether prefill chunks go to the native kernel too: where it multiplies them as AMX tiles or,
        on AVX-512 BF16 without them, as pair tiles (a tile of 16 keys turned into pairs once for all the
        block's query rows; `tile_scores`), for bfloat16 queries and cache, head size 64 or 128, blocks of
        16 tokens, at most 16 query heads per KV head: faster than torch's fused kernel over gathered K/V.
        Elsewhere the kernel's vector paths take one dot product per key and query row, several times
        slower than torch's, so chunks stay there."""
        s = self.spec
        return (
            self.kernel is not None
            and ((self.use_amx and "amx" in self.kernel.isa()) or self.kernel.attention_pair_tiles())
            and s.dtype == s.cache_dtype == torch.bfloat16
            and s.head_size == s.v_size
            and s.head_size in (64, 128)
            and s.block_size % 16 == 0
            and s.num_heads // s.num_kv_heads <= 16
        )

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        reasons = super().unsupported_reasons(spec, platform)
        if spec.batch_invariant and spec.latent_kv:
            reasons.append("no batch-invariant mode for latent KV (MLA) layers")
        elif spec.batch_invariant and spec.attention_chunk is not None:
            reasons.append(
                "no batch-invariant mode for chunked local attention (the native kernel has no chunks)"
            )
        elif spec.batch_invariant and platform.device_type == "cpu" and cpu_kernels.load() is None:
            reasons.append("batch-invariant mode needs the native kernel, which cannot be built here")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    def _store(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: CpuAttnMetadata
    ) -> None:
        """The new k/v into the cache: the kernel's row copies where the cache keeps k's dtype (a fused
        projection's views qualify), else `store_kv`."""
        if (
            self.kernel is not None
            and kv_cache.dtype == k.dtype == v.dtype
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        ):
            self.kernel.store_kv(kv_cache, k, v, metadata.batch.slot_mapping)
        else:
            store_kv(kv_cache, k, None if self.spec.latent_kv else v, metadata, heads_first=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttnMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's plan split three ways: the kernel's decodes, then each prefill chunk, then the
        PyTorch path's decode groups, each writing its own tokens' rows of `out`."""
        if sinks is not None:
            sinks = sinks.detach().float().contiguous()  # the layer's parameter already is
        num_kv, block_size = kv_cache.shape[1], kv_cache.shape[3]
        self._store(kv_cache, k, v, metadata)
        kernel = self.kernel is not None
        plan = metadata.plan(self.spec, block_size, kernel, num_kv, kernel and self.prefills_on_kernel)
        q = q.contiguous()
        out = torch.empty((*q.shape[:2], self.spec.v_size), dtype=q.dtype, device=q.device)
        if plan.kernel_reqs is not None:
            self._kernel_decodes(out, q, kv_cache, metadata, plan, sinks)
        for p in plan.prefills:
            self._prefill(out, q, k, v, kv_cache, p, sinks)
        for d in plan.decodes:
            self._decode_group(out, q, kv_cache, d, sinks)
        return out

    def _gather(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, len(blocks) * block_size, head_size] keys and [..., v_size] values, in the compute
        dtype (a latent layer's values: a view of its keys' first v_size elements)."""
        # rows: K and V, or the latent one; row: head_size (+ scale bytes, int8)
        rows, num_kv, num_blocks, block_size, row = kv_cache.shape
        blocks_of = kv_cache.view(rows, num_kv, num_blocks, block_size * row)
        shape = (num_kv, blocks.numel(), block_size * row)
        gathered = _workspace(rows * num_kv * blocks.numel() * block_size * row, kv_cache).view(rows, *shape)
        for i in range(rows):
            torch.index_select(blocks_of[i], 1, blocks, out=gathered[i])
        parts = [part.view(num_kv, -1, row) for part in gathered]
        if kv_cache.dtype == torch.int8:
            parts = [dequantize_int8_rows(part, dtype) for part in parts]
        else:
            parts = [part.to(dtype) for part in parts]
        return parts[0], parts[-1][..., : self.spec.v_size]

    def _kernel_decodes(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttnMetadata,
        plan: _Plan,
        sinks: torch.Tensor | None,
    ) -> None:
        """The plan's kernel requests through the native kernel, which reads K/V in place (one-byte caches
        as raw bytes)."""
        s = self.spec
        batch = metadata.batch
        kind, raw = _CACHE_KINDS[kv_cache.dtype], kv_cache
        if kv_cache.dtype.itemsize == 1:
            raw = kv_cache.view(torch.uint8)
        self.kernel.paged_attention(
            out,
            q,
            raw[0],
            raw[1],
            batch.block_tables,
            batch.seq_lens_cpu,
            batch.query_start_loc_cpu,
            plan.kernel_reqs,
            kind,
            s.softmax_scale,
            s.sliding_window or 0,
            plan.partition,
            self.use_amx,
            s.logits_soft_cap or 0.0,
            sinks,
            s.batch_invariant,
        )

    def _prefill(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        p: _Prefill,
        sinks: torch.Tensor | None,
    ) -> None:
        """One prefill chunk against the blocks it can see (or only its own new k/v): torch's fused kernel,
        or `explicit_attention` where that cannot cap logits or give the log-sum-exp for sinks."""
        s = self.spec
        cap, scale = s.logits_soft_cap, s.softmax_scale
        num_kv, head_size, v_size = kv_cache.shape[1], s.head_size, s.v_size
        group = s.num_heads // num_kv
        num_queries = p.tokens.stop - p.tokens.start
        qt = q[p.tokens].transpose(0, 1).view(num_kv, group, num_queries, head_size)
        if p.blocks is None:
            ctx_k, ctx_v = k[p.tokens].transpose(0, 1), v[p.tokens].transpose(0, 1)
        else:
            ctx_k, ctx_v = self._gather(kv_cache, p.blocks, q.dtype)
            width = p.mask.shape[-1]
            ctx_k, ctx_v = ctx_k[:, p.skip : p.skip + width], ctx_v[:, p.skip : p.skip + width]
        # torch's fused kernel cannot cap logits, nor give the log-sum-exp for sinks with V narrower than K
        if cap is not None or (s.has_sinks and v_size != head_size):
            o = explicit_attention(
                q[p.tokens].transpose(0, 1),
                ctx_k,
                ctx_v,
                p.mask,
                scale,
                cap,
                None if sinks is None else sinks.view(-1, 1),
            )
            out[p.tokens] = o.transpose(0, 1)
            return
        # 4-d inputs and K/V broadcast over each KV head's query heads keep torch on its fused kernel
        # (3-d or enable_gqa fall back to the unfused math path, ten times slower)
        ctx_k = ctx_k[:, None].expand(num_kv, group, *ctx_k.shape[1:])
        ctx_v = ctx_v[:, None].expand(num_kv, group, *ctx_v.shape[1:])
        if s.has_sinks:  # the fused kernel's own op, which also returns each row's log-sum-exp
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, ctx_k, ctx_v, 0.0, p.mask is None, attn_mask=p.mask, scale=scale
            )
            if sinks is not None:
                o = scale_by_sinks(o, lse, sinks.view(num_kv, group, 1))
        else:
            o = F.scaled_dot_product_attention(
                qt, ctx_k, ctx_v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale
            )
        out[p.tokens] = o.reshape(s.num_heads, num_queries, v_size).transpose(0, 1)

    def _decode_group(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        d: _DecodeGroup,
        sinks: torch.Tensor | None,
    ) -> None:
        """One group of decodes on the PyTorch path: two `bmm` calls over the gathered K/V with a float32
        softmax between them (capped scores, a sink column where the layer has sinks)."""
        s = self.spec
        cap, scale = s.logits_soft_cap, s.softmax_scale
        num_kv, head_size, v_size = kv_cache.shape[1], s.head_size, s.v_size
        group = s.num_heads // num_kv
        dq = q[d.tokens].view(-1, num_kv, group, head_size).transpose(0, 1)  # [KV, B, G, d]
        batch_size = dq.shape[1]
        dk, dv = self._gather(kv_cache, d.blocks, q.dtype)
        dk = dk.view(num_kv * batch_size, -1, head_size)  # [KV * B, width, d]
        dv = dv.view(num_kv * batch_size, -1, v_size)
        scores = torch.bmm(dq.reshape(num_kv * batch_size, group, head_size), dk.transpose(1, 2))
        scores = scores.view(num_kv, batch_size, group, -1)
        if cap is None:
            # one op: float32 scores, scaled, with padding and out-of-window positions at -inf
            scores = torch.add(d.mask, scores, alpha=scale)
        else:
            scores = torch.add(d.mask, torch.tanh(scores.float() * (scale / cap)), alpha=cap)
        if sinks is None:
            probs = scores.softmax(-1).to(q.dtype).view(num_kv * batch_size, group, -1)
        else:  # one more logit per row, dropped after the softmax
            column = sinks.view(num_kv, 1, group, 1).expand(num_kv, batch_size, group, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
            probs = probs.to(q.dtype).reshape(num_kv * batch_size, group, -1)
        o = torch.bmm(probs, dv).view(num_kv, batch_size, group, v_size)
        out.view(-1, num_kv, group, v_size)[d.tokens] = o.transpose(0, 1)


_workspaces: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer for gathered K/V, shared by every layer and step and grown when a step needs more.

    A fresh tensor of this size is page-faulted in on every call, which costs more than the copy itself;
    layers run one after another, so one buffer serves them all."""
    key = (like.dtype, like.device)
    buffer = _workspaces.get(key)
    stale = buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
    if buffer is None or buffer.numel() < numel or stale:  # an inference tensor is read-only outside
        buffer = _workspaces[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


_CACHE_KINDS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int8: 5,
}
"""Cache dtypes the native kernel reads, by the number it knows them by."""

KERNEL_ITEMS_PER_THREAD = 4
"""Below this many (request, KV head) pairs per thread, the kernel splits contexts into partitions."""
MIN_PARTITION = 256
"""Fewest context tokens per partition: smaller ones cost more to merge than they save."""


def _make_plan(
    batch: AttentionBatch,
    window: int,
    block_size: int,
    dtype: torch.dtype,
    kernel: bool,
    num_kv: int,
    invariant: bool = False,
    prefills_on_kernel: bool = False,
    chunk: int = 0,
) -> _Plan:
    """Split the step into prefill chunks and decodes; build the block lists and masks the PyTorch path
    needs, or the kernel's request list and partition size. Batch-invariant, or prefills on the kernel:
    every request to the kernel (batch-invariant: each context whole).

    Query token j of a request with L tokens of context and Q query tokens sits at position L - Q + j and
    sees positions <= that, and > that - window when a window is set, or those of its own chunk when
    `chunk` is set (never with the kernel). Blocks older than every query's window or chunk are not
    gathered."""
    starts = batch.query_start_loc_cpu.tolist()
    seq_lens = batch.seq_lens_cpu.tolist()
    if invariant and kernel:
        reqs = [i for i in range(len(seq_lens)) if starts[i + 1] > starts[i]]
        if not reqs:
            return _Plan([], [])
        longest = max(seq_lens[i] for i in reqs)
        return _Plan([], [], torch.tensor(reqs, dtype=torch.int32), longest)
    # the kernel reads a chunk's own keys from the cache: a step that stores nothing (a dummy step's slots
    # of -1) attends over its new k/v on torch's path
    prefills_on_kernel = prefills_on_kernel and not bool((batch.slot_mapping < 0).any())
    prefills, decodes = [], []
    for i, seq_len in enumerate(seq_lens):
        query_len = starts[i + 1] - starts[i]
        if query_len == 1 or (query_len > 1 and kernel and prefills_on_kernel):
            decodes.append(i)
        elif query_len > 1:
            prefills.append(
                _make_prefill(batch, i, starts[i], query_len, seq_len, (window, chunk), block_size, dtype)
            )
    if kernel:
        if not decodes:
            return _Plan(prefills, [])
        partition = _partition(decodes, seq_lens, [starts[i + 1] - starts[i] for i in decodes], num_kv)
        return _Plan(prefills, [], torch.tensor(decodes, dtype=torch.int32), partition)
    groups = []
    for members in _group_decodes(decodes, seq_lens, (window, chunk), block_size):
        groups.append(_make_decode_group(batch, members, starts, seq_lens, (window, chunk), block_size))
    return _Plan(prefills, groups)


def _partition(reqs: list[int], seq_lens: list[int], query_lens: list[int], num_kv: int) -> int:
    """Context tokens per kernel work item: whole contexts when there are enough (request, KV head)
    pairs to keep every thread busy, or a prefill chunk (whose blocks of query tokens the kernel spreads
    over the threads), else split so there are (flash-decoding)."""
    longest = max(seq_lens[i] for i in reqs)
    if max(query_lens) > 1:
        return longest
    wanted = KERNEL_ITEMS_PER_THREAD * torch.get_num_threads()
    pairs = len(reqs) * num_kv
    if pairs >= wanted:
        return longest
    splits = -(-wanted // pairs)
    return max(MIN_PARTITION, -(-longest // splits))


def _make_prefill(
    batch: AttentionBatch,
    req: int,
    start: int,
    query_len: int,
    seq_len: int,
    local: tuple[int, int],
    block_size: int,
    dtype: torch.dtype,
) -> _Prefill:
    """`local`: (window, chunk), 0 where not set."""
    device = batch.block_tables.device
    tokens = slice(start, start + query_len)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    if query_len == seq_len:  # nothing cached: attend over its own new k/v
        mask = None
        if any(0 < size < query_len for size in local):
            mask = _additive(_visible(query_pos[:, None], query_pos, local), dtype)
        return _Prefill(tokens, None, 0, mask)
    first = first_visible(seq_len - query_len, *local)
    first_block = first // block_size
    blocks = batch.block_tables[req, first_block : (seq_len + block_size - 1) // block_size].long()
    key_pos = torch.arange(first, seq_len, device=device)
    return _Prefill(
        tokens,
        blocks,
        first - first_block * block_size,
        _additive(_visible(query_pos[:, None], key_pos, local), dtype),
    )


def _group_decodes(
    reqs: list[int], seq_lens: list[int], window: tuple[int, int], block_size: int
) -> list[list[int]]:
    """Decodes of similar length, so one long context does not make every short one pay its padding, and
    few enough that their gathered context stays within DECODE_GROUP_TOKENS."""
    span = {i: _span_blocks(seq_lens[i], window, block_size) for i in reqs}
    groups: list[list[int]] = []
    for i in sorted(reqs, key=lambda i: span[i]):  # the newest member is the group's widest
        if (
            groups
            and span[i] <= DECODE_GROUP_SPREAD * span[groups[-1][0]]
            and (len(groups[-1]) + 1) * span[i] * block_size <= DECODE_GROUP_TOKENS
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _span_blocks(seq_len: int, local: tuple[int, int], block_size: int) -> int:
    """Blocks a decode at the end of `seq_len` tokens reads; `local`: (window, chunk), 0 where not set."""
    first = first_visible(seq_len - 1, *local)
    return (seq_len - 1) // block_size - first // block_size + 1


def _make_decode_group(
    batch: AttentionBatch,
    reqs: list[int],
    starts: list[int],
    seq_lens: list[int],
    local: tuple[int, int],
    block_size: int,
) -> _DecodeGroup:
    device = batch.block_tables.device
    lens = torch.tensor([seq_lens[i] for i in reqs], device=device)
    window, chunk = local
    if chunk:
        first_blocks = (lens - 1) // chunk * chunk // block_size
    else:
        first_blocks = (lens - window).clamp(min=0) // block_size if window else torch.zeros_like(lens)
    per_req = max(_span_blocks(seq_lens[i], local, block_size) for i in reqs)
    columns = first_blocks[:, None] + torch.arange(per_req, device=device)
    in_table = columns < (lens[:, None] + block_size - 1) // block_size
    rows = torch.tensor(reqs, device=device)
    table = batch.block_tables[rows[:, None], columns.clamp(max=batch.block_tables.shape[1] - 1)].long()
    blocks = torch.where(in_table, table, 0).view(-1)
    pos = first_blocks[:, None] * block_size + torch.arange(per_req * block_size, device=device)
    visible = _visible((lens - 1)[:, None], pos, local)  # [B, width]
    mask = _additive(visible, torch.float32)[None, :, None, :]
    token_ids = [starts[i] for i in reqs]
    contiguous = token_ids == list(range(token_ids[0], token_ids[0] + len(token_ids)))
    tokens = slice(token_ids[0], token_ids[-1] + 1) if contiguous else torch.tensor(token_ids, device=device)
    return _DecodeGroup(tokens, blocks, mask)


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, local: tuple[int, int]) -> torch.Tensor:
    """True where a query at `query_pos` may see a key at `key_pos` (broadcast): causal, within the window
    and the query's chunk where `local` (window, chunk) sets them."""
    window, chunk = local
    diff = query_pos - key_pos
    visible = diff >= 0
    if chunk:
        visible &= query_pos // chunk == key_pos // chunk
    return visible & (diff < window) if window else visible


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere, in the compute dtype, so the kernel adds it without converting."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [CpuAttnBackend]


# The compiled CPU graph's attention op where the kernels load: native for decode-only steps (see
# `CpuAttnMetadata.begin_forward`), else it calls pagellm::attention; implemented in cpu_kernels/ops.cpp.
torch.library.define("pagellm::cpu_attention", "(Tensor q, Tensor k, Tensor v, Tensor layer_index) -> Tensor")


@torch.library.register_fake("pagellm::cpu_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
