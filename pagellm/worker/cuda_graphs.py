"""CUDA graphs for decode steps: the model's forward captured once per padded batch size, then replayed.

A decode step of a small model spends most of its time launching kernels, one or more per layer and
operation; a replayed graph launches them all at once. The forward is captured at start-up, after the KV
cache exists, for every size in `capture_sizes` (vLLM's `cuda_graph_sizes` idea), reading its inputs from
static device buffers: token ids, positions, and the attention batch (query start locations, sequence
lengths, block tables, slot mapping). A decode-only step of n requests copies its inputs into those
buffers and replays the smallest graph of at least n rows; the padding rows are one token at slot 0 of
the null block (which no request owns) with a context of that one token, and their outputs are dropped.
Every other step (prefills and mixed steps) runs eagerly, and so does the whole engine with LoRA, a split
model, speculative decoding or a pooling runner (`decode_graphs_allowed`).

The attention metadata is built once per captured size, outside the graph, over the static buffers, so
the backend must allow it (`AttentionBackend.cuda_graph_decode`). A metadata tensor that the backend
computes from the batch (FLASH_ATTN's cumulative context lengths) is computed again before each replay
and copied into the captured one. With several KV cache groups (`core/kv_cache_spec.py`) each group has
its own block-table and slot-mapping buffers and metadata, and each layer is captured reading its group's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagellm.core.attention import AttentionBackend, AttentionBatch
from pagellm.core.transfer import copy_to
from pagellm.models.context import set_forward_context
from pagellm.worker.step import EngineSetup, StepArrays

logger = logging.getLogger("pagellm")

MAX_CAPTURE_SIZE = 512
"""Largest batch captured (vLLM's default); larger decode steps run eagerly."""
WARM_UP_RUNS = 2
"""Eager runs before each capture, so lazy initialisation (library handles, workspaces, Triton
compilation) happens outside it, as PyTorch's CUDA-graph documentation asks."""


def decode_graphs_allowed(setup: EngineSetup, *, lora: bool, split: bool, speculative: bool) -> bool:
    """CUDA graphs for decode steps where the platform and the backend allow them, unless --enforce-eager.
    Never with LoRA (each step's adapter rows differ), a split model (collectives), speculative decoding
    (the draft model reads every step's inputs) or a pooling runner (no decode)."""
    config = setup.config
    return (
        not config.enforce_eager
        and setup.platform.supports_cuda_graphs()
        and setup.backend.cuda_graph_decode
        and not lora
        and not split
        and not speculative
        and config.runner != "pooling"
    )


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (itself included) or MAX_CAPTURE_SIZE."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class Graph(Protocol):
    """What the runner needs of a captured graph: torch.cuda.CUDAGraph's `replay`."""

    def replay(self) -> None: ...


class Capture(Protocol):
    """How graphs are made: `TorchCapture` on a device, a stand-in in tests."""

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None: ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]: ...


class TorchCapture:
    """Captures on a CUDA (or ROCm) device with torch.cuda.graph; every graph allocates from one memory
    pool, so capturing the largest size first lets the smaller ones reuse its memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        """Run `fn` eagerly on a side stream, as PyTorch's documentation does before a capture."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """The graph of `fn` and its output tensor, which each replay overwrites."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph, output


@dataclass
class _Captured:
    graph: Graph
    output: torch.Tensor  # [size, hidden]
    batch: AttentionBatch  # over the static buffers' first `size` rows (KV cache group 0's)
    metadata: Any  # what build_metadata returned for `batch`
    derived: tuple[str, ...]  # the metadata's tensors computed from the batch, refreshed before a replay
    more_groups: tuple[tuple[AttentionBatch, Any, tuple[str, ...]], ...] = ()  # the same, groups 1, 2, ...

    def groups(self) -> list[tuple[AttentionBatch, Any, tuple[str, ...]]]:
        return [(self.batch, self.metadata, self.derived), *self.more_groups]


class DecodeGraphs:
    """The decode forward captured for each of `sizes`; `run` replays the smallest that fits a step."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        backend: type[AttentionBackend],
        kv_caches: list[torch.Tensor],
        layers: list,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        layer_groups: list[int] | None = None,
    ):
        """`layer_groups`: each layer's KV cache group by layer_idx, with several groups (None: one)."""
        self.forward = forward
        self.backend = backend
        self.kv_caches = kv_caches
        self.layers = layers
        self.layer_groups = layer_groups
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        n, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        num_groups = max(layer_groups) + 1 if layer_groups else 1
        # the padding rows' values: token 0 at position 0, stored at slot 0 (the null block's), context 1
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # per KV cache group; `block_tables` and `slot_mapping` are group 0's
        self.group_tables = [
            torch.zeros(n, max_blocks, dtype=torch.int32, device=device) for _ in range(num_groups)
        ]
        self.group_slots = [torch.zeros(n, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.block_tables, self.slot_mapping = self.group_tables[0], self.group_slots[0]
        self.graphs: dict[int, _Captured] = {}

    def capture(self, make: Capture) -> None:
        """Capture every size, largest first."""
        for size in reversed(self.sizes):
            batches = [self._batch(size, g) for g in range(len(self.group_tables))]
            metadata = [self.backend.build_metadata(batch) for batch in batches]
            layer_metadata = None
            if self.layer_groups is not None:
                layer_metadata = [metadata[g] for g in self.layer_groups]

            def fn(size=size, metadata=metadata[0], layer_metadata=layer_metadata) -> torch.Tensor:
                with set_forward_context(
                    metadata, self.kv_caches, self.layers, layer_metadata=layer_metadata
                ):
                    return self.forward(self.input_ids[:size], self.positions[:size])

            make.warm_up(fn)
            graph, output = make.capture(fn)
            groups = [(b, m, _derived(m, b)) for b, m in zip(batches, metadata, strict=True)]
            self.graphs[size] = _Captured(graph, output, *groups[0], more_groups=tuple(groups[1:]))

    def bucket(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds `num_reqs` requests; None when none does."""
        return next((s for s in self.sizes if s >= num_reqs), None)

    def run(self, step: StepArrays) -> torch.Tensor | None:
        """The step's final hidden states [num_reqs, hidden] from a replay; None, with nothing done, when
        the step is not decode-only (a request runs more than one token) or no graph is large enough."""
        num_reqs = step.seq_lens.shape[0]
        size = self.bucket(num_reqs)
        if size is None or step.input_ids.shape[0] != num_reqs:
            return None
        lengths = step.rope_lengths  # the graphs rotate each token for length position + 1: a decode token
        if lengths is not None and not np.array_equal(lengths, step.positions + 1):
            return None  # a prompt token of a longer prompt (a one-token chunk) runs eagerly
        captured = self.graphs[size]
        self._copy_inputs(step, size)
        for batch, metadata, derived in captured.groups():
            if derived:
                fresh = self.backend.build_metadata(batch)
                for name in derived:
                    getattr(metadata, name).copy_(getattr(fresh, name))
        captured.graph.replay()
        return captured.output[:num_reqs]

    def _batch(self, size: int, group: int = 0) -> AttentionBatch:
        return AttentionBatch(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.group_tables[group][:size],
            slot_mapping=self.group_slots[group][:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _copy_inputs(self, step: StepArrays, size: int) -> None:
        """The step's rows, then padding rows, into the static buffers' first `size` rows. Columns of the
        block table past the step's widest row keep older values: no request reads past its length."""
        n = step.seq_lens.shape[0]
        width = step.block_tables.shape[1]
        copies = [(self.input_ids, step.input_ids, 0), (self.positions, step.positions, 0)]
        copies.append((self.seq_lens, step.seq_lens, 1))
        for g, (step_tables, step_slots) in enumerate(step.kv_groups()):
            tables = np.zeros((size, width), dtype=np.int32)
            tables[:n] = step_tables
            copy_to(self.group_tables[g][:size, :width], torch.from_numpy(tables))
            copies.append((self.group_slots[g], step_slots, 0))
        for dst, src, pad in copies:
            padded = np.full(size, pad, dtype=src.dtype)
            padded[:n] = src
            copy_to(dst[:size], torch.from_numpy(padded))


def _derived(metadata: Any, batch: AttentionBatch) -> tuple[str, ...]:
    """Names of the metadata's tensor attributes that are not the batch's own tensors."""
    own = {id(v) for v in vars(batch).values() if isinstance(v, torch.Tensor)}
    attributes = vars(metadata) if hasattr(metadata, "__dict__") else {}
    return tuple(k for k, v in attributes.items() if isinstance(v, torch.Tensor) and id(v) not in own)


@torch.inference_mode()
def capture_decode_graphs(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    backend: type[AttentionBackend],
    kv_caches: list[torch.Tensor],
    layers: list,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    layer_groups: list[int] | None = None,
) -> DecodeGraphs | None:
    """Capture the decode graphs, logging how many and how long; None, with a warning, on failure (the
    engine then runs every step eagerly)."""
    started = time.monotonic()
    sizes = capture_sizes(max_num_seqs)
    graphs = DecodeGraphs(
        forward, backend, kv_caches, layers, sizes, max_model_len, block_size, device, layer_groups
    )
    try:
        graphs.capture(TorchCapture(device))
    except Exception as e:  # a model or kernel that cannot be captured: slower, not broken
        logger.warning("capturing CUDA graphs failed, running eagerly: %s: %s", type(e).__name__, e)
        return None
    logger.info(
        "captured %d CUDA graphs for decode steps of 1-%d requests in %.1fs (--enforce-eager turns this off)",
        len(sizes),
        sizes[-1],
        time.monotonic() - started,
    )
    return graphs
