"""The `AttentionBackend` interface: one paged-attention implementation.

The class holds the facts (what it runs on) and the per-step metadata builder; an instance is one
attention layer's implementation. Tensor conventions, for every backend:

- q: [num_tokens, num_heads, head_size]; k: [num_tokens, num_kv_heads, head_size]; v: [num_tokens,
  num_kv_heads, v_size] (`AttentionSpec.v_size`: head_size unless the spec says otherwise)
- the batch is flat: request i owns tokens query_start_loc[i]:query_start_loc[i+1]; its query tokens are
  the last ones of its sequence of seq_lens[i] tokens (prefill chunks and single-token decodes mixed)
- kv_cache: a tensor of the backend's own `kv_cache_shape`; `forward` writes the new k/v into it at
  `slot_mapping` (slot = block_id * block_size + offset; negative = do not store) and reads the context
  through `block_tables`
- forward returns [num_tokens, num_heads, v_size]
- a `latent_kv` spec (Multi-head Latent Attention, DeepSeek-V2/V3) keeps one row per token and KV head
  instead of a K row and a V row: K is the row, V its first v_size elements (the latent vector c_kv of
  [c_kv, k_pe]); `v` is then a view of k's first v_size elements and only k is stored. Its cache is
  `layer_cache_shape`: `kv_cache_shape` with 1 where K and V were 2
- per layer, from its spec: scores are q.k * `softmax_scale`, then `logits_soft_cap * tanh(score / cap)` when
  a cap is set, then masked (causal; at most `sliding_window` most recent positions when set); with
  `has_sinks`, `forward` also gets `sinks` (float32 [num_heads]): one logit per query head that joins each
  row's softmax denominator and contributes no value (GPT-OSS), so out = sum_i e^s_i v_i / (sum_i e^s_i +
  e^sink)
- a `bidirectional_spans` spec (Gemma 3's image tokens) also lets the queries of each span that the step's
  `AttentionBatch.bidirectional` names see the span's later keys: a query at position q sees key k when
  k <= q or both lie in one span, and, with a sliding window, q - k < sliding_window all the same (so a
  span's earlier keys beyond the window stay hidden, as in transformers' Gemma 3). The scheduler keeps a
  span's uncached tokens in one step, so every key a query may see is in the cache or in the step.
- an `attention_chunk` spec (chunked local attention, Llama 4's rope layers) splits each sequence into
  chunks of that many positions: a query at position q sees key k when k <= q and k // chunk == q // chunk,
  i.e. k in [q // chunk * chunk, q] (so never more than `chunk` keys, like a window of that size but
  restarting at every chunk boundary). It does not combine with `sliding_window`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagellm.core.dtypes import INT8_SCALE_BYTES, dtype_name

if TYPE_CHECKING:
    from pagellm.core.platform import Platform

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV-cache block when neither the user nor the backend says otherwise."""


@dataclass(frozen=True)
class AttentionSpec:
    """The shapes and features a model asks of its attention layers."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: torch.dtype | None = None  # None: same as dtype
    sliding_window: int | None = None  # attend to at most this many most recent tokens (incl. itself)
    logits_soft_cap: float | None = None  # scores become cap * tanh(score / cap), after the scale
    scale: float | None = None  # None: head_size ** -0.5
    has_sinks: bool = False  # a learned logit per query head in every softmax (`forward`'s `sinks`)
    v_head_size: int | None = None  # V's and the output's head size; None: head_size. Only with latent_kv
    latent_kv: bool = False  # one cached row per token and KV head: K, whose first v_size elements are V
    bidirectional_spans: bool = False  # the batch's `bidirectional` spans attend both ways (image tokens)
    batch_invariant: bool = False  # a token's output is the same bits whatever else the step holds
    # the attention layer (an earlier one, of the same KV cache spec) whose KV cache this layer reads: it keeps
    # none of its own and is handed that layer's k and v of the step (Gemma 4's shared-KV layers); None: its own
    kv_source: int | None = None
    attention_chunk: int | None = None  # chunked local attention: a query sees only its own chunk's keys
    # sparse attention (DeepSeek-V3.2's indexer): each query reads only the index_topk earlier tokens its
    # layer's lightning indexer picks (models/layers/sparse_attention.py gathers them through the block table)
    index_topk: int | None = None

    def __post_init__(self) -> None:
        if self.attention_chunk is not None and (self.attention_chunk < 1 or self.sliding_window is not None):
            raise ValueError("attention_chunk must be positive and does not combine with a sliding window")
        if self.v_head_size is not None and not self.latent_kv:
            raise ValueError("v_head_size is for latent_kv specs, whose V is a prefix of K's cached row")
        if self.v_head_size is not None and not 0 < self.v_head_size <= self.head_size:
            raise ValueError(f"v_head_size {self.v_head_size} must be within head_size {self.head_size}")

    @property
    def v_size(self) -> int:
        """Elements of one head of V and of the output."""
        return self.v_head_size if self.v_head_size is not None else self.head_size

    @property
    def kv_rows(self) -> int:
        """Rows the cache keeps per token and KV head: K and V, or the one latent row."""
        return 1 if self.latent_kv else 2

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def cache_row_size(self) -> int:
        """Elements of one cached K or V row: head_size, plus the float32 scale's bytes in an int8 cache."""
        return self.head_size + (INT8_SCALE_BYTES if self.cache_dtype == torch.int8 else 0)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_size**-0.5

    def shape_key(self) -> str:
        """Identifies the shapes for the selector's timing cache."""
        return (
            f"h{self.num_heads}-kv{self.num_kv_heads}-d{self.head_size}-{dtype_name(self.dtype)}"
            f"-bs{self.block_size}-sw{self.sliding_window}"
            + (f"-cap{self.logits_soft_cap:g}" if self.logits_soft_cap is not None else "")
            + ("-sinks" if self.has_sinks else "")
            + (f"-latent-v{self.v_size}" if self.latent_kv else "")
            + ("-bidir" if self.bidirectional_spans else "")
            + ("-invariant" if self.batch_invariant else "")
            + (f"-chunk{self.attention_chunk}" if self.attention_chunk is not None else "")
            + (f"-topk{self.index_topk}" if self.index_topk is not None else "")
        )


@dataclass
class AttentionBatch:
    """What every backend gets from the model runner once per step (device tensors unless `_cpu`)."""

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc_cpu: torch.Tensor  # the same, on the host, so backends need not sync
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # (request index, first position, end position): positions [first, end) of that request's sequence
    # attend to each other both ways (one image's tokens), for `bidirectional_spans` specs; every span
    # overlaps the request's query tokens and its later positions are all among them
    bidirectional: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """One paged-attention implementation. Subclass, fill the facts, implement the four methods."""

    name: ClassVar[str]
    """Upper-case name users pass to `--attention-backend`."""
    version: ClassVar[str] = "1"
    """Bump when speed changes, so the selector's timing cache is refreshed."""
    device_types: ClassVar[tuple[str, ...] | None] = None
    """torch device types it runs on; None: any."""
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """KV-cache dtypes it reads (`--kv-cache-dtype`); None: the same as `dtypes`."""
    head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    block_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    """Whether `forward` takes `sinks` (specs with `has_sinks`); the layer passes it only for those."""
    supports_latent_kv: ClassVar[bool] = False
    """Whether it runs `latent_kv` specs (MLA): one cached row per token, V its prefix, outputs of v_size."""
    supports_bidirectional_spans: ClassVar[bool] = False
    """Whether it runs `bidirectional_spans` specs: the batch's spans attend both ways (image tokens)."""
    supports_attention_chunk: ClassVar[bool] = False
    """Whether it runs `attention_chunk` specs: chunked local attention (Llama 4's rope layers)."""
    supports_index_topk: ClassVar[bool] = False
    """Whether its cache layout is the one `models/layers/sparse_attention.py` gathers selected rows from
    (`index_topk` specs: one slot-major row per token); the sparse layers run their own attention."""
    supports_batch_invariant: ClassVar[bool] = False
    """Whether it runs `batch_invariant` specs: each query token's output the same bits whether it comes in
    a prefill chunk or a decode, alone or beside any other requests (`--batch-invariant`)."""
    not_in_compiled_graphs: ClassVar[str | None] = None
    """Why a compiled forward cannot call it (the model runner then runs the forward eagerly and says why),
    or None."""
    graph_op: Any = None
    """An op (q [T, H*D], k, v [T, KV*D], layer_idx) -> [T, H*D] that compiled graphs call instead of
    `pagellm::attention` (the Python op, which calls `forward`), or None. It must give the same results and
    may call `pagellm::attention` for steps it does not handle (CPU_ATTN's native op does)."""
    cuda_graph_decode: ClassVar[bool] = False
    """Whether a decode-only step's `forward` may be captured in a CUDA graph and replayed with new
    inputs (worker/cuda_graphs.py). The runner builds the metadata once per captured batch size, over
    fixed-size device tensors (padding rows: one token at a slot of the null block, seq_len 1; no
    negative slot; `max_seq_len` is the model's maximum and `seq_lens_cpu` says so too), and before each
    replay copies the step into the batch's tensors and into the metadata's other tensor attributes
    (computed again by `build_metadata`). So `forward` must read the step only through those tensors: no
    host sync, no `.tolist()` of a device tensor, no tensor made from host values (one cached on the
    metadata may depend on the number of requests alone)."""

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        """Every reason this backend cannot run `spec` on `platform`; empty means compatible.

        The default checks the class facts; override to add more (a missing package, a capability),
        calling super()."""
        reasons = []
        if cls.device_types is not None and platform.device_type not in cls.device_types:
            reasons.append(f"runs on device types {', '.join(cls.device_types)}, not {platform.device_type}")
        if spec.dtype not in cls.dtypes:
            reasons.append(f"dtype {dtype_name(spec.dtype)} not in {', '.join(map(dtype_name, cls.dtypes))}")
        cache_dtypes = cls.kv_cache_dtypes or cls.dtypes
        if spec.cache_dtype not in cache_dtypes:
            reasons.append(
                f"KV-cache dtype {dtype_name(spec.cache_dtype)} not in {', '.join(map(dtype_name, cache_dtypes))}"
            )
        if cls.head_sizes is not None and spec.head_size not in cls.head_sizes:
            reasons.append(f"head size {spec.head_size} not in {list(cls.head_sizes)}")
        if cls.block_sizes is not None and spec.block_size not in cls.block_sizes:
            reasons.append(f"block size {spec.block_size} not in {list(cls.block_sizes)}")
        if spec.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("no sliding-window support")
        if spec.logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            reasons.append("no logits soft-cap support")
        if spec.has_sinks and not cls.supports_sinks:
            reasons.append("no attention-sink support")
        if spec.latent_kv and not cls.supports_latent_kv:
            reasons.append("no latent KV cache (MLA) support")
        if spec.bidirectional_spans and not cls.supports_bidirectional_spans:
            reasons.append("no bidirectional spans (image tokens that attend both ways)")
        if spec.batch_invariant and not cls.supports_batch_invariant:
            reasons.append("no batch-invariant mode")
        if spec.attention_chunk is not None and not cls.supports_attention_chunk:
            reasons.append("no chunked local attention")
        if spec.index_topk is not None and not cls.supports_index_topk:
            reasons.append("no sparse attention (an indexer's top-k tokens; only TORCH_SDPA's cache layout)")
        return reasons

    @classmethod
    def preferred_block_size(cls) -> int:
        """The KV-cache block size the selector checks, times and runs this backend with when the user
        gives no --block-size. The default is 16, or the smallest of `block_sizes` when 16 is not one of
        them; override it when the kernels need or run best with other blocks."""
        if cls.block_sizes is None or DEFAULT_BLOCK_SIZE in cls.block_sizes:
            return DEFAULT_BLOCK_SIZE
        return min(cls.block_sizes)

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        """Shape of one layer's KV cache tensor; `head_size` is the spec's `cache_row_size`."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def layer_cache_shape(cls, spec: AttentionSpec, num_blocks: int, block_size: int) -> tuple:
        """Shape of one layer's cache for `spec`: `kv_cache_shape` of its rows (`cache_row_size`), whose first
        axis holds K and V; a `latent_kv` spec keeps one row per token, so that axis is 1 there. A backend
        that supports latent specs with the K/V axis elsewhere overrides this."""
        shape = tuple(cls.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.cache_row_size))
        return (1, *shape[1:]) if spec.latent_kv else shape

    @classmethod
    def build_metadata(cls, batch: AttentionBatch) -> Any:
        """Turn the step's batch into what `forward` needs; called once per step, shared by all layers."""
        return batch

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v into kv_cache at the slot mapping, then attend; see the module docstring.

        `sinks` (float32 [num_heads], on q's device) is passed only for a spec with `has_sinks`, by a backend
        that `supports_sinks`; None there (the selector's timing) means no sink logit, on the same path."""
        raise NotImplementedError
