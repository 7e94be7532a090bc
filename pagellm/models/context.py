"""What the engine hands a model's layers: `ModelInit` when they are built, and the per-step forward
context (what attention layers need besides their inputs) while they run.

The model runner sets the forward context around each forward; `Attention` layers read it. This keeps
model code free of batch plumbing (the same idea as nano-vllm's context).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.core.attention import AttentionBackend
from pagellm.core.quant import QuantMethod
from pagellm.core.state import RecurrentKernels
from pagellm.distributed import Parallel


@dataclass
class ModelInit:
    """Engine choices a model needs to build its layers."""

    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    attention_backend: type[AttentionBackend]
    block_size: int = 16
    quant_method: QuantMethod | None = None  # an instance, shared by every linear layer
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype
    parallel: Parallel = field(default_factory=Parallel)  # this rank's tensor/pipeline-parallel place
    expert_parallel: bool = False  # MoE layers split their experts over the tensor-parallel ranks
    # the checkpoint's whole config, for a multimodal model (its vision_config); hf_config is its decoder's
    model_config: Any = None
    batch_invariant: bool = False  # --batch-invariant: attention specs ask for batch-invariant kernels


@dataclass
class LoRABatch:
    """The step's tokens that run with an adapter (`rows`) and each one's slot (`slots`). A layer whose
    per-slot matrices are `width` columns each multiplies all those rows by every slot's A at once and
    keeps only each row's own slot's columns (`mask`), then by the stacked B: two matmuls a layer however
    many adapters the step has, and rows of the base model are not touched."""

    rows: torch.Tensor  # [N] token indices
    slots: torch.Tensor  # [N] slot of each
    num_slots: int
    _masks: dict = field(default_factory=dict)

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[N, num_slots * width]: 1 in the columns of the row's own slot, else 0."""
        key = (width, dtype)
        if key not in self._masks:
            column_slot = torch.arange(self.num_slots * width, device=self.slots.device) // width
            self._masks[key] = (column_slot.unsqueeze(0) == self.slots.unsqueeze(1)).to(dtype)
        return self._masks[key]


@dataclass
class StateBatch:
    """The step's requests' recurrent states (`core/state.py`): each request's slot, where its tokens lie
    in the flat batch, and whether the step starts it from nothing (its first tokens: the slot holds a
    finished or preempted request's state, which must not be read)."""

    slots: torch.Tensor  # [B] int64, on the device
    slot_list: list[int]  # the same, on the host
    query_start_loc: list[int]  # [B + 1]
    fresh: list[bool]  # [B]
    caches: Sequence[tuple[torch.Tensor, ...]]  # by state_idx: the layer's tensors, [slots, *shape] each
    kernels: RecurrentKernels = RecurrentKernels()  # the platform's; None fields run the references
    # per request: its rows past its known tokens (drafts to verify); None when the step has none
    drafts: list[int] | None = None
    # what the layers leave for after the verification: a request's states as they were before the step,
    # and how to advance them by the rows it keeps (`DraftReplay`), one per layer and drafting request
    replays: list[DraftReplay] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        """Every request adds one token to a state it already has (a vectorised update serves them all)."""
        return not any(self.fresh) and self.query_start_loc[-1] == len(self.slot_list)


@dataclass
class DraftReplay:
    """One recurrent layer's state of one request in a step that verifies drafts: the step advanced it over
    all of the request's `rows` (its last known token and the drafts); after the verification only the
    accepted ones count, so `keep(n)` puts back the state from before the step and advances it over the
    first n rows again (their conv and recurrence only: the layer's inputs of those rows are kept)."""

    request: int  # index in the step's batch
    rows: int
    replay: Any  # (n) -> None: restore the state from before the step, then advance it over n rows

    def keep(self, n: int) -> None:
        if n < self.rows:
            self.replay(n)


@dataclass
class ImageBatch:
    """The step's rows that are image placeholders and what replaces their token embeddings: `embeds[i]`
    goes to flat row `rows[i]` (the vision encoder's output, worker/encoder_cache.py). A model whose encoder
    also feeds later decoder layers (Qwen3-VL's deepstack) has those rows in `deepstack`, one tensor per
    layer, aligned with `rows` the same way."""

    rows: torch.Tensor  # [N] int64
    embeds: torch.Tensor  # [N, hidden] in the model's dtype
    deepstack: list[torch.Tensor] | None = None  # each [N, hidden]


@dataclass
class ForwardContext:
    metadata: Any  # what the attention backend's build_metadata returned for this step
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by Attention.layer_idx
    attention_layers: Sequence[Any] = ()  # the `Attention` layers by layer_idx, for the compiled graph's op
    lora: LoRABatch | None = None  # the step's tokens that run with a LoRA adapter
    # [T] int64: each token's sequence length for a length-dependent rope (models/layers/rotary.py)
    rope_lengths: torch.Tensor | None = None
    # with several KV cache groups: each layer's metadata (its group's block tables and slots), by
    # layer_idx; None: `metadata` serves every layer
    layer_metadata: Sequence[Any] | None = None
    # a model with recurrent layers: the step's states; None otherwise (and in a memory-profiling step,
    # where such layers compute from zero states and keep nothing)
    state: StateBatch | None = None
    # a multimodal model's step with image placeholder rows; None otherwise
    images: ImageBatch | None = None
    # what the step's layers work out once and share, by a key of the layer kind's choosing (sparse
    # attention's context slots per KV-cache group); a new context, so a new memo, every forward
    memo: dict[Any, Any] = field(default_factory=dict)

    def metadata_of(self, layer_idx: int) -> Any:
        """The metadata attention layer `layer_idx` runs with."""
        return self.metadata if self.layer_metadata is None else self.layer_metadata[layer_idx]


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention layer called outside set_forward_context(); the model runner sets it")
    return _context


@contextmanager
def set_forward_context(
    metadata: Any,
    kv_caches: list[torch.Tensor],
    attention_layers: Sequence[Any] = (),
    lora: LoRABatch | None = None,
    rope_lengths: torch.Tensor | None = None,
    layer_metadata: Sequence[Any] | None = None,
    state: StateBatch | None = None,
    images: ImageBatch | None = None,
) -> Iterator[None]:
    """`metadata` for every layer, or, with several KV cache groups, `layer_metadata[layer_idx]` for each
    (then `metadata` is group 0's)."""
    global _context
    previous, _context = (
        _context,
        ForwardContext(
            metadata, kv_caches, attention_layers, lora, rope_lengths, layer_metadata, state, images
        ),
    )
    # a backend's metadata may prepare native state for the forward (CPU_ATTN's compiled-graph op), over
    # one step's tables for every layer: not with several groups, whose layers read different tables
    begin = end = None
    if layer_metadata is None:
        begin, end = getattr(metadata, "begin_forward", None), getattr(metadata, "end_forward", None)
    try:
        if begin is not None:
            begin(kv_caches, attention_layers)
        yield
    finally:
        if end is not None:
            end()
        _context = previous


def lora_batch() -> LoRABatch | None:
    """The current step's LoRA tokens; None outside a step or when none has an adapter."""
    return _context.lora if _context is not None else None


def rope_lengths() -> torch.Tensor | None:
    """The current step's per-token sequence lengths for a length-dependent rope; None outside a step or
    when the runner sent none (then each token's is its position + 1)."""
    return _context.rope_lengths if _context is not None else None
